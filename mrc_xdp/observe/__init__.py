"""Observation: ``metrics`` (the Prometheus endpoint over the pinned maps) and ``top``
(the live terminal view).  Depends on ``datapath``, ``transport`` and ``health``.
"""
