"""Framework adapters: ``ckptturbo.integrations.lightning``, ``.accelerate``,
``.transformers``, ``.ray_train`` and ``.vllm``.

Each lives in its own module and imports its framework there (Ray on first use), so
importing ``ckptturbo`` never imports a framework. They reach the core through its public
names (``import ckptturbo as ct``), ``ckptturbo.errors``, ``ckptturbo.stream`` and
``ckptturbo.adapter_support`` only (docs/architecture.md); ``_core`` holds what they share.
See docs/integrations.md.
"""
