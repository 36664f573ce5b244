#!/usr/bin/env bash
# Build the mrc-xdp lab guest image from Debian's packages only.  Called by
# `mrc-xdp lab vm build-box` (mrc_xdp/lab/vm.py), which passes:
#
#   OUT    cache directory (default /var/cache/mrc-xdp/vm): rootfs/, base.qcow2, vmlinuz,
#          initrd.img, id_lab (the lab's ssh key), build.json
#   KROOT  an unpacked Debian kernel (tools/kmatrix.py's cache: KROOT/boot/vmlinuz-KVER,
#          KROOT/lib/modules/KVER) and KVER its release
#   SRC    the mrc-xdp checkout to install in the guest (/opt/mrc-xdp); FILES: a list of
#          the files of it to copy (default: every file git knows that is not ignored)
#   MIRROR Debian mirror (default http://deb.debian.org/debian)
#
# No loop device, no bootloader: the root file system is an unpartitioned ext4 made by
# `mkfs.ext4 -d` from a debootstrap tree; guests boot the kernel directly (QEMU -kernel,
# vagrant-libvirt libvirt.kernel).  Stages are cached in OUT/rootfs (markers .stage-*):
# debootstrap (~3 min) and the project's set-up (scripts/setup.sh inside the tree, the
# README's own set-up, ~2-4 min) run once; a rebuild with changed sources re-copies the
# checkout, reruns setup.sh (seconds when nothing it installs changed) and remakes the disk.
set -euo pipefail
OUT=${OUT:-/var/cache/mrc-xdp/vm}
: "${KROOT:?}" "${KVER:?}" "${SRC:?}"
MIRROR=${MIRROR:-http://deb.debian.org/debian}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R=$OUT/rootfs
say() { printf '[%(%H:%M:%S)T] build-image: %s\n' -1 "$*"; }
mkdir -p "$OUT"

MOUNTED=()
umount_all() {
    local m
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTED[$i]}" 2>/dev/null || true; done
    MOUNTED=()
}
trap umount_all EXIT
mount_chroot() {
    mount -t proc proc "$R/proc"; MOUNTED+=("$R/proc")
    mount --bind /dev "$R/dev"; MOUNTED+=("$R/dev")
    mount --bind /sys "$R/sys"; MOUNTED+=("$R/sys")
    mount -o remount,bind,ro "$R/sys"
    mount -t tmpfs tmpfs "$R/tmp"; MOUNTED+=("$R/tmp")
}

# ---------------------------------------------------------------- 1. debootstrap
PKGS=kmod,openssh-server,sudo,iproute2,iputils-ping,isc-dhcp-client,initramfs-tools
PKGS+=,python3,procps,ethtool,bpftool,less,netbase
if [ ! -e "$R/.stage-debootstrap" ]; then
    say "debootstrap bookworm minbase (+ $PKGS)"
    rm -rf "$R"
    debootstrap --variant=minbase --include="$PKGS" bookworm "$R" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 \
        || { tail -n 5 "$OUT/debootstrap.log" >&2; echo "debootstrap failed (log: $OUT/debootstrap.log)" >&2; exit 1; }
    touch "$R/.stage-debootstrap"
fi

# ---------------------------------------------------------------- 2. kernel
if [ ! -e "$R/.stage-kernel-$KVER" ]; then
    say "kernel $KVER from $KROOT"
    rm -rf "$R"/lib/modules "$R"/usr/lib/modules "$R"/boot/vmlinuz-* "$R"/boot/initrd.img-*
    mkdir -p "$R/usr/lib/modules"
    cp -a "$KROOT/lib/modules/$KVER" "$R/lib/modules/"
    cp "$KROOT/boot/vmlinuz-$KVER" "$R/boot/"
    # only these in the initramfs (MODULES=dep would look at the build host)
    printf 'virtio_pci\nvirtio_blk\nvirtio_net\next4\n' > "$R/etc/initramfs-tools/modules"
    sed -i 's/^MODULES=.*/MODULES=list/' "$R/etc/initramfs-tools/initramfs.conf"
    # (the kernel cache ran depmod already.)  mkinitramfs reads the kernel's config for the
    # compressions it supports; the unpacked kernel has none: Debian's kernels do zstd.
    [ -f "$R/boot/config-$KVER" ] || printf 'CONFIG_RD_ZSTD=y\nCONFIG_RD_GZIP=y\n' > "$R/boot/config-$KVER"
    chroot "$R" mkinitramfs -o "/boot/initrd.img-$KVER" "$KVER" >"$OUT/initramfs.log" 2>&1 \
        || { tail -n 5 "$OUT/initramfs.log" >&2; echo "mkinitramfs failed (log: $OUT/initramfs.log)" >&2; exit 1; }
    rm -f "$R"/.stage-kernel-*
    touch "$R/.stage-kernel-$KVER"
fi

# ---------------------------------------------------------------- 3. configuration
say "configure (ssh keys, lab-init, users)"
echo lab > "$R/etc/hostname"
printf '/dev/vda / ext4 defaults,noatime 0 1\n' > "$R/etc/fstab"
# the lab's key: vm.lab_key() made it (a rendering names it too); made here only by hand
[ -f "$OUT/id_lab" ] || ssh-keygen -q -t ed25519 -N '' -C mrc-xdp-lab -f "$OUT/id_lab"
install -d -m 700 "$R/root/.ssh"
VKEY=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -1 || true)
{ cat "$OUT/id_lab.pub"; [ -z "$VKEY" ] || cat "$VKEY"; } > "$R/root/.ssh/authorized_keys"
chmod 600 "$R/root/.ssh/authorized_keys"
chroot "$R" passwd -d root >/dev/null               # serial console login
if ! chroot "$R" id vagrant >/dev/null 2>&1; then
    chroot "$R" useradd -m -s /bin/bash vagrant
fi
echo vagrant:vagrant | chroot "$R" chpasswd
echo 'vagrant ALL=(ALL) NOPASSWD: ALL' > "$R/etc/sudoers.d/vagrant"
chmod 440 "$R/etc/sudoers.d/vagrant"
install -d -m 700 -o 1000 -g 1000 "$R/home/vagrant/.ssh"
install -m 600 -o 1000 -g 1000 "$R/root/.ssh/authorized_keys" "$R/home/vagrant/.ssh/authorized_keys"
printf 'UseDNS no\nPermitRootLogin prohibit-password\n' > "$R/etc/ssh/sshd_config.d/lab.conf"
sed -i 's/^#\?timeout .*/timeout 15;/' "$R/etc/dhcp/dhclient.conf"
install -m 755 "$HERE/lab-init" "$R/sbin/lab-init"
install -m 755 "$HERE/lab-poweroff" "$R/sbin/lab-poweroff"

# ---------------------------------------------------------------- 4. the project
say "mrc-xdp checkout -> /opt/mrc-xdp"
D=$R/opt/mrc-xdp
mkdir -p "$D"
# keep .venv, the built engine and the editable install's metadata (mrc_xdp.egg-info: the
# console script `mrc-xdp` finds its entry point there): setup.sh reinstalls only when
# their inputs changed
so=$(cd "$D" && ls mrc_xdp/transport/_engine*.so 2>/dev/null || true)
[ -z "$so" ] || mv "$D/$so" "$OUT/engine.so.keep"
find "$D" -mindepth 1 -maxdepth 1 ! -name .venv ! -name build ! -name '*.egg-info' -exec rm -rf {} +
if [ -n "${FILES:-}" ]; then        # the list vm.py hashed (package, bpf/, set-up)
    tar -C "$SRC" -cf - -T "$FILES" | tar -C "$D" -xf -
else
    (cd "$SRC" && git ls-files -c -o --exclude-standard | while read -r f; do [ -e "$f" ] && echo "$f"; done \
        | tar -cf - -T -) | tar -C "$D" -xf -
fi
[ -z "$so" ] || mv "$OUT/engine.so.keep" "$D/$so"
cp /etc/resolv.conf "$R/etc/resolv.conf"
say "scripts/setup.sh inside the tree (the README's set-up)"
mount_chroot
echo 'APT::Install-Recommends "false";' > "$R/etc/apt/apt.conf.d/90lab"
# MRC_SETUP_EXTRAS=0: no matplotlib, tmux, iperf3, tcpdump (evaluation and benchmarks only;
# MRC_GUEST_EXTRAS=1 keeps them)
if ! chroot "$R" env MRC_SETUP_EXTRAS="${MRC_GUEST_EXTRAS:-0}" bash /opt/mrc-xdp/scripts/setup.sh \
        >"$OUT/setup.log" 2>&1; then
    tail -n 8 "$OUT/setup.log" >&2
    echo "scripts/setup.sh failed inside the image (log: $OUT/setup.log)" >&2
    exit 1
fi
umount_all
rm -f "$R"/var/cache/apt/archives/*.deb "$R"/var/cache/apt/*.bin
rm -rf "$R"/var/lib/apt/lists/* "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/info/*
find "$R/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'en*' -exec rm -rf {} + 2>/dev/null || true

# ---------------------------------------------------------------- 5. disk
say "mkfs.ext4 -d, qcow2"
used_mb=$(du -sm "$R" | cut -f1)
size_mb=$(( (used_mb * 3 / 2 + 1024 + 511) / 512 * 512 ))
rm -f "$OUT/base.raw" "$OUT/base.qcow2.tmp"
truncate -s "${size_mb}M" "$OUT/base.raw"
mkfs.ext4 -q -F -L labroot -E root_owner=0:0 -d "$R" "$OUT/base.raw"
qemu-img convert -O qcow2 "$OUT/base.raw" "$OUT/base.qcow2.tmp"
rm -f "$OUT/base.raw"
mv "$OUT/base.qcow2.tmp" "$OUT/base.qcow2"
cp "$R/boot/vmlinuz-$KVER" "$OUT/vmlinuz"
cp "$R/boot/initrd.img-$KVER" "$OUT/initrd.img"
say "done: $OUT/base.qcow2 ($(du -m "$OUT/base.qcow2" | cut -f1) MB, ${size_mb} MB ext4), kernel $KVER"
