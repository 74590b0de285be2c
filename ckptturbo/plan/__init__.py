"""Write and read plans: which rank writes or reads which bytes. Pure functions, no I/O.

Every rank computes the same plan from the same inputs, so nothing here may depend on
hash seeds, set order or the order items arrive in: inputs are sorted by key (or chunk
id) first and every tie is broken by rank number.

- ``writes``: ``plan_writes`` (each replicated byte written by exactly one holder, in
  chunk-aligned ranges) and ``plan_stats`` (how far a plan is from the lower bound);
- ``reads``: ``plan_readers`` (each chunk read by one rank) and ``plan_reads`` (with the
  chain that forwards it);
- ``balance``: the balancing both use, with its bounds and their proofs;
- ``spans``: byte-span maths of a load (which bytes of a stored box a read needs, which
  chunks those touch);
- ``checks``: validation of the inputs, shared by both planners;
- ``digests``: ranks with equal local plans, recognised by a digest (``PlanDigest``).
"""
from .reads import ChainAssignment, ReadNeed, plan_readers, plan_reads
from .spans import box_span, chunks_touched, numel, overlapping, row_major_strides
from .writes import ByteRange, PlanItem, plan_stats, plan_writes

__all__ = [
    "PlanItem",
    "ByteRange",
    "ReadNeed",
    "ChainAssignment",
    "plan_writes",
    "plan_readers",
    "plan_reads",
    "plan_stats",
    "box_span",
    "chunks_touched",
    "numel",
    "overlapping",
    "row_major_strides",
]
