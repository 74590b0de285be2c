"""Framework adapters: ``ckptturbo.integrations.lightning``, ``.accelerate``, ``.transformers``.

Each lives in its own module and imports its framework at module top, so importing
``ckptturbo`` never imports a framework. See docs/integrations.md.
"""
