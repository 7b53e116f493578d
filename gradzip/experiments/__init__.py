"""The experiment runner: specs (TOML grids of training runs), sweeps that run every cell and skip
finished ones, ``gradzip run`` for the specs that ship with gradzip (``specs/``). It sits on top of
the training program (:mod:`gradzip.training`) and the plots (:mod:`gradzip.plots`)."""
