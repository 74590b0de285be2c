"""Stream safetensors models from any fsspec location: ``stream_safetensors`` and ``safe_open``.

Modules, in the order bytes flow: ``source`` (what a model location means: listing,
index, cache, store), ``format`` (the strict header parser), ``headers`` (one GET per
header, its data tail kept), ``ranges`` (which byte ranges to read, in yield order),
``iterator`` (the stream: prefetch, assemble, yield), ``device`` (CPU or pinned CUDA
destinations), ``distributed`` (read once across ranks through ``ckptturbo.readonce``),
``options`` / ``profiles`` (settings, presets), ``calibrate`` (measure the best preset
for a store), ``cache`` (the optional local-disk tier), ``safe_open`` (lazy single-file
access) with ``readahead`` (its reads in the order of the calls) and ``nextfile`` (the
next shards of a ``safe_open`` loop, read ahead before they are opened).
"""
from .calibrate import calibrate
from .iterator import SafetensorsStream, stream_safetensors
from .options import StreamOptions
from .profiles import StreamProfile
from .safe_open import SafeOpen, TensorSlice, safe_open

__all__ = ["stream_safetensors", "safe_open", "calibrate", "SafetensorsStream", "SafeOpen",
           "TensorSlice", "StreamProfile", "StreamOptions"]
