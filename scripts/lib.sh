# Shell functions shared by the setup scripts (setup.sh, kmatrix-setup.sh, vm-setup.sh).
# Source it after defining say and die: each script prefixes its messages with its name.

# apt_ensure [-q] LOG PKG...: install those of the Debian packages PKG... that are not
# installed (apt-get update, then apt-get install --no-install-recommends), apt-get's
# output to LOG (its last lines are shown when apt-get fails).  When all are installed
# it only checks (one dpkg-query) and says so, unless -q.
apt_ensure() {
    local quiet=0
    if [ "${1-}" = -q ]; then quiet=1; shift; fi
    local log=$1; shift
    local pkgs=("$@") missing=() installed p
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${pkgs[@]}" 2>/dev/null || true)
    for p in "${pkgs[@]}"; do
        awk -v p="$p" '$1 == p && $2 == "ii" { found = 1 } END { exit !found }' <<<"$installed" \
            || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        [ "$quiet" -eq 1 ] || say "apt packages: all ${#pkgs[@]} present"
        return 0
    fi
    say "installing apt packages: ${missing[*]}"
    say "updating package lists (apt-get update)"
    apt-get -o DPkg::Lock::Timeout=300 update -q >"$log" 2>&1 \
        || { tail -n 15 "$log" >&2; die "apt-get update failed (log: $log); check the Debian mirror in /etc/apt/sources.list*"; }
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
        --no-install-recommends "${missing[@]}" >>"$log" 2>&1 \
        || { tail -n 15 "$log" >&2; die "apt-get install ${missing[*]} failed (log: $log)"; }
    say "apt packages installed"
}
