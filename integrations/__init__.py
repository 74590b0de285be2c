"""Framework adapters (Lightning, Accelerate, transformers, Ray Train, vLLM).

Each adapter lives in its own module and imports its framework lazily; the core never
imports a framework. None is shipped yet: use ``ckptturbo.TurboWriter``/``TurboReader``
with ``torch.distributed.checkpoint`` directly (see docs/usage.md).
"""
