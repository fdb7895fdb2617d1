"""``python -m lightning_ratel.convert``: the converter under the name users run it by (``ratel-convert`` is the same
command). The code lives in :mod:`lightning_ratel.io.convert`."""

from lightning_ratel.io.convert import main, sharded_to_hf, sharded_to_lightning

__all__ = ["main", "sharded_to_hf", "sharded_to_lightning"]

if __name__ == "__main__":
    raise SystemExit(main())
