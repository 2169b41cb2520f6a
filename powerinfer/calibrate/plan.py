"""The calibration batches of a run: which tokens, in which split, at which row.

Profiling counts over one split (``all``); predictor training over two (``train``, then
``heldout``). :func:`build_plan` tokenizes and packs each split with
:func:`powerinfer.data.calibration_batches` (so the batches are exactly the ones the
whole-model pass used) and lays them out:

* ``Batch.token``: the batch's first row in the run's hidden-state file (all splits,
  batch order), ``Batch.split_row``: its first row within its split (the predictor
  training rows of that split are written there);
* :meth:`CalibrationPlan.shard` gives a process of a ``torchrun`` job a contiguous run
  of batches, so the ranks' rows, taken in rank order, are the one-process order.

Tokenizing is deterministic, so a resumed or distributed run rebuilds the same plan
from the same text instead of storing it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import PowerInferError

__all__ = ["Batch", "CalibrationPlan", "build_plan", "shortfall_notes", "check_tokens"]


@dataclass(frozen=True)
class Batch:
    """One ``[rows, seq]`` batch of token ids of split ``split``."""

    split: str
    ids: torch.Tensor = field(repr=False)
    token: int  # first row in the run's hidden-state file
    split_row: int  # first row within the split

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.ids.shape[0]), int(self.ids.shape[1])


@dataclass
class CalibrationPlan:
    """All batches of a run, in order, and the token count of each split."""

    splits: list[str]
    batches: list[Batch]

    @property
    def n_tokens(self) -> dict[str, int]:
        out = {s: 0 for s in self.splits}
        for b in self.batches:
            out[b.split] += b.n_tokens
        return out

    @property
    def total_tokens(self) -> int:
        return sum(b.n_tokens for b in self.batches)

    def shard(self, rank: int, world: int) -> list[Batch]:
        """Rank ``rank``'s batches of ``world``: a contiguous run, sizes differing by at most one."""
        n = len(self.batches)
        lo, hi = rank * n // world, (rank + 1) * n // world
        return self.batches[lo:hi]


def build_plan(data: str, tokenizer, caps: dict[str, int | None], seq_len: int, batch_size: int,
               heldout: float = 0.1, text_field: str = "text") -> CalibrationPlan:
    """Tokenize and pack each split of ``data`` (``caps``: split -> token cap, None = all).

    Raises PowerInferError (from :mod:`powerinfer.data`) for missing or unusable text, and
    when a split yields no tokens.
    """
    from ..data import calibration_batches

    batches: list[Batch] = []
    token = 0
    for split, cap in caps.items():
        row = 0
        for ids in calibration_batches(data, tokenizer, cap, seq_len, batch_size, split=split, heldout=heldout,
                                       text_field=text_field):
            batches.append(Batch(split, ids, token, row))
            token += ids.numel()
            row += ids.numel()
        if row == 0:
            raise PowerInferError(f"{data}: the {split} split of the calibration data gave no tokens")
    return CalibrationPlan(list(caps), batches)


def shortfall_notes(plan: CalibrationPlan, caps: dict[str, int | None], data: str) -> list[str]:
    """One line per split whose text gave under half the tokens asked for (for the stages' logs)."""
    got = plan.n_tokens
    return [f"{data}: {SPLIT_NAMES.get(split, f'the {split} split')} gave only {got[split]} tokens of the {cap} "
            f"asked for (the text ran out; more text gives better statistics)"
            for split, cap in caps.items() if cap is not None and got[split] < 0.5 * cap]


SPLIT_NAMES = {"all": "the calibration text", "train": "the training split (--max-tokens)",
               "heldout": "the held-out split (--heldout-tokens)"}  # as the shortfall notes name them


def check_tokens(plan: CalibrationPlan, tokenizer, vocab_size: int | None, model_dir: str) -> None:
    """Refuse token streams the model cannot or should not be calibrated on.

    * an id at or past the model's ``vocab_size`` (a tokenizer from another model);
    * more than half the tokens special or unknown (BOS/EOS/UNK/PAD): the tokenizer files
      are missing or do not fit the text (transformers then builds a near-empty tokenizer
      that turns any text into separators, and the counts would mean nothing).

    Raises PowerInferError naming the model folder.
    """
    ids = torch.cat([b.ids.reshape(-1) for b in plan.batches])
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise PowerInferError(f"{model_dir}: the tokenizer produced token id {int(ids.max())} but the model's "
                              f"vocab_size is {vocab_size}: tokenizer and weights are from different models")
    special = sorted({int(t) for t in (getattr(tokenizer, "all_special_ids", None) or []) if t is not None})
    if special:
        share = float(torch.isin(ids, torch.tensor(special)).float().mean())
        if share > 0.5:
            raise PowerInferError(f"{model_dir}: {share:.0%} of the calibration tokens are special or unknown "
                                  f"tokens: the tokenizer files are missing or do not fit this text")
