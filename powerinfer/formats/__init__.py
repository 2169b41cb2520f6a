"""Readers and writers for the files of the PowerInfer contract: the files upstream PowerInfer
(github.com/SJTU-IPADS/PowerInfer) writes and reads, which this toolkit writes and reads alike.

Docstrings across the package cite the contract by section, as "FORMATS.md section N" (the
developers' notes on upstream's formats; not shipped). Each section is implemented and
documented here:

1. the model families, and when an FFN neuron counts as active: :mod:`powerinfer.families`;
2. activation statistics, ``activation_{i}.pt`` per layer: :mod:`.activation`;
3. predictors, ``model_{i}.pt`` per layer plus ``config.json``: :mod:`.predictor`;
4. the PowerInfer GGUF (``PWRI`` magic): :mod:`.gguf_file` and :mod:`.gguf_validate`, written
   by :mod:`powerinfer.convert.writer`;
5. GPU index files, ``<model file>.generated.gpuidx``: :mod:`.gpuidx`, built by
   :mod:`powerinfer.convert.gpu_index`;
6. neuron placement under a VRAM budget: :mod:`powerinfer.convert.placement`.
"""
