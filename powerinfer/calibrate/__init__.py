"""The calibration pass shared by ``pi-profile`` and ``pi-train-predictor``.

Layer-streamed, as GPTQ/AWQ calibrate models larger than memory: embed every calibration
token once, then load one decoder layer at a time from the checkpoint, run all tokens
through it, count FFN activations and record predictor training rows, and keep its
outputs as the next layer's inputs. Modules, bottom up:

* :mod:`.checkpoint` -- single tensors from safetensors / ``.bin`` shards, by name;
* :mod:`.layers` -- a transformers model on the meta device, one layer materialised at a time;
* :mod:`.store` -- row files for hidden states and predictor rows; mask bit-packing;
* :mod:`.plan` -- the calibration batches and their rows; torchrun shards;
* :mod:`.hooks` -- the active-neuron hooks, thread choice, the ReLU-family check;
* :mod:`.distributed` -- torchrun (gloo / nccl) and device resolution;
* :mod:`.stream` -- the pass itself, resumable per layer;
* :mod:`.session`, :mod:`.options` -- what both stages and their CLIs share.
"""
