"""The tiny test model (built by ``kvcompose.engine.model``), under the name tests and
``examples/pd/serve.sh`` use: ``python -m kvcompose.testing.tiny_model [DIR]`` prints its path."""

from kvcompose.engine.model import _main, build_tiny_model, default_cache_dir, tiny_model

__all__ = ["build_tiny_model", "default_cache_dir", "tiny_model"]

if __name__ == "__main__":
    _main()
