"""Packaging for mrc-xdp.

Install with ``make setup`` (scripts/setup.sh), which makes .venv from Debian's
/usr/bin/python3 with --system-site-packages and runs ``pip install -e .`` in it.
bcc's Python module exists only as Debian's python3-bpfcc, so it is not (and must
never be) listed as a dependency: PyPI's "bcc" is an unrelated package.

The BPF sources in bpf/ are data of the package.  In the editable install (the one
this project uses) mrc_xdp/datapath/shared.py finds them as bpf/, the sibling of the package
directory.  A built wheel carries the same files as mrc_xdp/bpf/ (package_dir below).
"""
from setuptools import find_packages, setup

VERSION = "0.2.0"

# ---------------------------------------------------------------------------------
# C extension: the transport engine (mrc_xdp/transport/engine/engine.c, AF_XDP via libxdp, zlib's
# CRC-32), built with cffi in API mode at install time by mrc_xdp/transport/engine/build.py into
# mrc_xdp/transport/_engine*.so (cffi's setuptools hook, from Debian's python3-cffi, builds it in
# place for the editable install).  Its sources are in STAMP_INPUTS of scripts/setup.sh,
# so `make setup` rebuilds it when they change.  .gitignore covers the generated
# /mrc_xdp/transport/_engine*.c and *.so.
CFFI_MODULES: list[str] = ["mrc_xdp/transport/engine/build.py:ffibuilder"]
# ---------------------------------------------------------------------------------

extra = {}
if CFFI_MODULES:
    extra["cffi_modules"] = CFFI_MODULES
    extra["setup_requires"] = ["cffi>=1.15"]

setup(
    name="mrc-xdp",
    version=VERSION,
    description="MRC (RDMA multipath transport) for Linux hosts: XDP datapath, "
                "Python control plane, network-namespace lab",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="GPL-2.0-only OR BSD-2-Clause",
    python_requires=">=3.11",
    packages=find_packages(include=["mrc_xdp", "mrc_xdp.*"]) + ["mrc_xdp.bpf"],
    package_dir={"mrc_xdp.bpf": "bpf"},
    package_data={"mrc_xdp.bpf": ["*.h", "*.c"], "mrc_xdp.lab": ["*.toml"],
                  "mrc_xdp.transport.engine": ["*.h", "*.c"]},
    include_package_data=False,
    zip_safe=False,
    # Debian packages provide these (python3-cffi, python3-pyroute2, python3-scapy) and
    # bcc (python3-bpfcc); setup.sh installs with --no-deps and checks the imports.
    install_requires=["cffi>=1.15", "pyroute2>=0.7", "scapy>=2.5"],
    entry_points={"console_scripts": ["mrc-xdp = mrc_xdp.cli:main"]},
    classifiers=[
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: C",
        "Topic :: System :: Networking",
    ],
    **extra,
)
