"""What the framework adapters (``ckptturbo.integrations``) use of the core beyond ``ct.*``.

An adapter imports ``ckptturbo`` (the public names), ``ckptturbo.errors`` and this module,
nothing else of the core (``tests/test_architecture.py`` checks it): the core's modules
can then move and change without touching five adapters, and what adapters rely on is
written down here.
"""
from __future__ import annotations

from .agreement import agree, gather, settle
from .failures import ckptturbo_errors
from .paths import OWN_STORE, RUN_STORE
from .tree import SKELETON_KEY, flatten
from .urls import parent_url

__all__ = [
    "OWN_STORE",  # store="checkpoint": a checkpoint that holds its own chunks
    "RUN_STORE",  # store="run": chunks shared by the run's checkpoints (the default)
    "SKELETON_KEY",  # the flat key under which ``flatten`` keeps a tree's structure
    "agree",  # a step every rank runs, whose failure anywhere is raised everywhere
    "ckptturbo_errors",  # a block whose failures leave as ckptturbo errors naming a URL
    "flatten",  # a nested state as flat keys ct.save takes, restorable exactly
    "gather",  # every rank's value on every rank, failures agreed (one outcome)
    "settle",  # a step every rank runs, its result kept here, its failure raised everywhere
    "parent_url",  # the run (chunk store) a checkpoint URL belongs to: its parent
]
