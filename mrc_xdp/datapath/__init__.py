"""The datapath's control plane: everything between the XDP programs in bpf/ and the rest.

- ``shared``: the C/Python contract (bpf/mrc_shared.h read through cffi: structs, enums,
  map names, counters); ``wire``: MRC packet layouts, ICRC, test frames.
- ``config`` / ``validate`` / ``names``: host configuration (TOML), checks, instance names.
- ``bpfsrc`` (compile with bcc), ``kheaders`` (a headers tree for bcc), ``bpfsys``
  (libbpf through cffi: maps, pins, links, ring buffers, test runs).
- ``loader``: load / attach / unload an instance; ``maps``: the pinned maps of a loaded
  instance (``Instance``: EV table, counters, planes, config).
- ``netns``: enter a named network namespace.

Depends on nothing else in mrc_xdp.
"""
