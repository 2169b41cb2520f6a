"""A Hugging Face ``*ForCausalLM`` whose decoder layers live on disk until asked for.

The model is built from its config on PyTorch's ``meta`` device (no memory, no random
init) with transformers' own classes, so attention, RoPE, masks and norms are exactly
transformers' code. Then:

* the *stem* -- every module outside the decoder-layer list except an untied output
  head (the token and position embeddings, RoPE's frequency buffers, the final norm) --
  is materialised on the device, its weights read from the checkpoint
  (:class:`~powerinfer.calibrate.checkpoint.CheckpointReader`) and non-persistent
  buffers recomputed by transformers' ``_init_weights``;
* :meth:`LayerStack.layer_inputs` runs the model's own forward on token ids and stops it
  at the entrance of layer 0 (a forward pre-hook raises), returning the hidden states and
  the exact arguments the model passes every decoder layer (causal or sliding-window mask,
  RoPE ``position_embeddings``, ``position_ids``): GPTQ's "catcher" trick;
* :meth:`LayerStack.load_layer` reads one decoder layer's tensors in the compute dtype and
  :meth:`LayerStack.free_layer` sends it back to ``meta``.

Peak memory is the stem plus one layer, whatever ``n_layer`` is.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import PowerInferError
from ..families import Family, get_attr
from .checkpoint import CheckpointReader

__all__ = ["LayerStack"]


class _Caught(Exception):
    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("layer 0 reached")
        self.args_, self.kwargs_ = args, kwargs


def _meta_tensors(module: torch.nn.Module) -> list[str]:
    return [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]


class LayerStack:
    """Decoder layers of a local HF model folder, one at a time (see the module docstring).

    ``dtype``: compute dtype of every weight and of the hidden states; ``device``: where
    the stem and the loaded layer live. Raises PowerInferError for unreadable configs or
    checkpoints and for checkpoints that lack a tensor the model needs.
    """

    def __init__(self, model_dir: str | Path, family: Family, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForCausalLM

        from ..hf import load_hf_config

        self.model_dir, self.family, self.dtype, self.device = Path(model_dir), family, dtype, torch.device(device)
        config = load_hf_config(model_dir)
        self.reader = CheckpointReader(model_dir, "")
        self._check_layer_count(int(config.num_hidden_layers))
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
        self.model.eval()
        self.layers = list(get_attr(self.model, family.layers_attr))
        self.n_layer = len(self.layers)
        self.reader.prefix = self.model.base_model_prefix
        self._kwargs: dict[tuple[int, int], tuple[tuple, dict]] = {}
        self.check_shapes()
        self._materialize_stem()

    # ------------------------------------------------------------------ checks before any work
    def _check_layer_count(self, n_config: int) -> None:
        """The config's ``num_hidden_layers`` must be the checkpoint's layer count (a wrong one
        would profile part of the model, or fail hours in)."""
        import re

        last = re.escape(self.family.layers_attr.split(".")[-1])
        pat = re.compile(rf"(?:^|\.){last}\.(\d+)\.")
        found = {int(m.group(1)) for n in self.reader.names() if (m := pat.search(n))}
        n_ckpt = max(found) + 1 if found else 0
        if n_config != n_ckpt:
            raise PowerInferError(f"{self.model_dir / 'config.json'}: num_hidden_layers is {n_config} but the "
                                  f"checkpoint holds {n_ckpt} decoder layers")

    def check_shapes(self) -> None:
        """Every tensor of every decoder layer is in the checkpoint with the shape the config
        implies (read from the shard headers: no weights are loaded). Raises PowerInferError."""
        for i, layer in enumerate(self.layers):
            for name, t in layer.state_dict(keep_vars=True).items():
                key = self.layer_key(i, name)
                shape = self.reader.shape(key)
                if shape is None:
                    raise PowerInferError(f"{self.model_dir}: checkpoint has no tensor {key!r}, which the model needs")
                if shape != tuple(t.shape):
                    raise PowerInferError(f"{self.model_dir}: tensor {key!r} has shape {shape}, the config implies "
                                          f"{tuple(t.shape)}")
        self.reader.close()

    # ------------------------------------------------------------------ sizes
    def n_params(self) -> int:
        """Parameters of the whole model (tied weights counted once), as transformers builds it."""
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def layer_key(self, i: int, name: str) -> str:
        return f"{self.family.layers_attr}.{i}.{name}"

    # ------------------------------------------------------------------ loading
    def _load_into(self, module: torch.nn.Module, prefix: str, skip: set[int] = frozenset()) -> None:
        """Materialise ``module`` (recursively) on the device with checkpoint weights.

        Non-persistent buffers are recomputed by the model's ``_init_weights`` (RoPE
        frequencies); every persistent tensor must be in the checkpoint. ``skip``: ids of
        parameters to leave on meta (an untied output head).
        """
        state = {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) not in skip}
        for sub in module.modules():
            if any(b is not None and b.is_meta and n in sub._non_persistent_buffers_set
                   for n, b in sub._buffers.items()):
                sub.to_empty(device=self.device, recurse=False)
                self.model._init_weights(sub)
        loaded = {}
        for name, t in state.items():
            key = f"{prefix}{name}"
            if key not in self.reader:
                raise PowerInferError(f"{self.model_dir}: checkpoint has no tensor {key!r}, which the model needs")
            loaded[name] = self.reader.get(key, self.dtype if t.is_floating_point() else None, self.device)
            if t.is_floating_point() and not loaded[name].is_floating_point():
                raise PowerInferError(f"{self.model_dir}: tensor {key!r} holds {loaded[name].dtype}, not floats")
            if tuple(loaded[name].shape) != tuple(t.shape):
                raise PowerInferError(f"{self.model_dir}: tensor {key!r} has shape {tuple(loaded[name].shape)}, "
                                      f"the config implies {tuple(t.shape)}")
        module.load_state_dict(loaded, strict=False, assign=True)

    def _materialize_stem(self) -> None:
        layer_ids = {id(t) for layer in self.layers for t in list(layer.parameters()) + list(layer.buffers())}
        head = self.model.get_output_embeddings()
        emb = self.model.get_input_embeddings()
        skip = {id(p) for p in head.parameters()} - {id(p) for p in emb.parameters()} if head is not None else set()
        skip |= layer_ids
        layers_list = get_attr(self.model, self.family.layers_attr)
        for name, child in self.model.named_children():
            self._load_stem_module(child, name + ".", skip, layers_list, head)
        self.reader.close()

    def _load_stem_module(self, module: torch.nn.Module, prefix: str, skip: set[int],
                          layers_list: torch.nn.Module, head: torch.nn.Module | None) -> None:
        if module is layers_list or module is head:
            return
        if any(m is layers_list for m in module.modules()):  # descend around the layer list
            own = {n: t for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None}
            if own:
                raise PowerInferError(f"{self.model_dir}: unexpected tensors {sorted(own)} beside the layer list")
            for name, child in module.named_children():
                self._load_stem_module(child, prefix + name + ".", skip, layers_list, head)
            return
        self._load_into(module, prefix, skip)
        left = _meta_tensors(module)
        if left:
            raise PowerInferError(f"{self.model_dir}: could not materialise {prefix}{left[0]}")

    def load_layer(self, i: int) -> torch.nn.Module:
        """Decoder layer ``i`` with its checkpoint weights in ``dtype`` on the device, in eval mode."""
        layer = self.layers[i]
        self._load_into(layer, self.layer_key(i, ""))
        self.reader.close()  # unmap the shards: touched pages of a map count as resident memory
        left = _meta_tensors(layer)
        if left:
            raise PowerInferError(f"{self.model_dir}: layer {i} tensor {left[0]!r} was not loaded")
        return layer.eval()

    def free_layer(self, i: int) -> None:
        """Send layer ``i``'s tensors back to the meta device (frees their memory)."""
        self.layers[i].to(device="meta")

    # ------------------------------------------------------------------ layer-0 inputs
    def _catch(self, ids: torch.Tensor) -> tuple[tuple, dict]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            raise _Caught(args, kwargs)

        handle = self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.inference_mode():
                self.model.base_model(input_ids=ids.to(self.device), use_cache=False)
        except _Caught as c:
            return c.args_, c.kwargs_
        finally:
            handle.remove()
        raise PowerInferError("the model's forward never reached decoder layer 0")

    def layer_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, T, n_embd]`` (``dtype``, on the device) entering layer 0 for ``ids`` ``[B, T]``."""
        args, kwargs = self._catch(ids)
        return args[0] if args else kwargs["hidden_states"]

    def layer_kwargs(self, shape: tuple[int, int]) -> tuple[tuple, dict]:
        """Extra positional and keyword arguments the model passes every decoder layer for a
        ``[B, T]`` batch without padding (mask, RoPE tables, positions; they depend only on
        the shape), computed once per shape by the model's own forward."""
        got = self._kwargs.get(shape)
        if got is None:
            args, kwargs = self._catch(torch.zeros(shape, dtype=torch.long))
            kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            got = self._kwargs[shape] = (tuple(args[1:]), kwargs)
        return got

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """One decoder layer's output ``[B, T, n_embd]`` for input ``hidden`` ``[B, T, n_embd]``."""
        args, kwargs = self.layer_kwargs(tuple(hidden.shape[:2]))
        out = layer(hidden, *args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def close(self) -> None:
        self.reader.close()
