"""Seeded, real optimizer-step checkpoints of a small transformer, for tests and benches.

Owns: a tiny causal transformer LM, a short supervised warm-up (so AdamW's
moments look like those of a trained model, not of step one), then RL steps
with a REINFORCE loss at RL learning rates, and the served copies (bf16, fp8)
of each fp32 master state. No files are written here; callers cache if they
want. Everything is deterministic for a given seed on one torch build.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from patchswarm.protocol.dtypes import SERVED_DTYPES


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    vocab: int = 256
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    ff: int = 1024
    seq: int = 24

    @classmethod
    def of_size(cls, params: str) -> "ModelSpec":
        """`tiny` (~0.1M, unit tests), `small` (~3.3M, default), `medium` (~26M, bench),
        `large` (~58M: a bench patch ~2x medium's, where per-version fixed costs weigh less)."""
        sizes = {
            "tiny": cls(vocab=64, d_model=64, layers=2, heads=2, ff=256, seq=12),
            "small": cls(),
            "medium": cls(vocab=1024, d_model=512, layers=8, heads=8, ff=2048, seq=24),
            "large": cls(vocab=1024, d_model=768, layers=8, heads=12, ff=3072, seq=24),
        }
        try:
            return sizes[params]
        except KeyError:
            raise ValueError(f"model size: expected one of {sorted(sizes)}, found {params!r}") from None


class Block(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(s.d_model)
        self.attn = nn.MultiheadAttention(s.d_model, s.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(s.d_model)
        self.mlp = nn.Sequential(nn.Linear(s.d_model, s.ff), nn.GELU(), nn.Linear(s.ff, s.d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A causal LM small enough to train on two CPU cores in seconds."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.spec = s
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Parameter(torch.randn(s.seq, s.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.embed(tokens) + self.pos[:t]
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.zeros(batch, 1, dtype=torch.long)
        for _ in range(length - 1):
            logits = self(tokens)[:, -1]
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt], 1)
        return tokens


def _reward(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Verifiable toy reward: fraction of strictly increasing adjacent pairs."""
    return (tokens[:, 1:] > tokens[:, :-1]).float().mean(1)


def _sequence_logprob(model: TinyLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return lp.sum(1)


def served(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The served copy: every floating tensor cast to `dtype` (round to nearest)."""
    return {k: (v.to(dtype) if v.is_floating_point() else v.clone()).contiguous() for k, v in state.items()}


def master_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


class _RLRun:
    """One seeded run: the warm-up, then RL steps taken as callers ask for more of them.

    Everything after the model's initialisation draws from the run's own generator, so
    the states of `steps` RL steps are the first steps+1 of any longer run: a test module
    that asks for 3 after one that asked for 6 (in the same pytest worker) gets a prefix,
    not a second training.
    """

    def __init__(self, size: str, lr: float, seed: int, warmup: int):
        self.spec = spec = ModelSpec.of_size(size)
        torch.manual_seed(seed)
        self.gen = gen = torch.Generator().manual_seed(seed)
        self.model = model = TinyLM(spec)
        self.opt = opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
        for _ in range(warmup):
            data = torch.randint(0, spec.vocab, (16, spec.seq), generator=gen)
            data = torch.sort(data, dim=1).values  # a learnable structure
            loss = nn.functional.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        for g in opt.param_groups:
            g["lr"] = lr
        self.states = [master_state(model)]

    def states_after(self, steps: int) -> tuple[dict[str, torch.Tensor], ...]:
        while len(self.states) <= steps:
            tokens = self.model.sample(16, self.spec.seq, self.gen)
            r = _reward(tokens, self.spec.vocab)
            adv = r - r.mean()
            loss = -(adv * _sequence_logprob(self.model, tokens)).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.states.append(master_state(self.model))
        return tuple(self.states[: steps + 1])


@functools.lru_cache(maxsize=8)
def _rl_run(size: str, lr: float, seed: int, warmup: int) -> _RLRun:
    return _RLRun(size, lr, seed, warmup)


@functools.lru_cache(maxsize=8)
def rl_checkpoints(
    size: str = "small", lr: float = 1e-6, steps: int = 3, seed: int = 0, warmup: int = 30
) -> tuple[dict[str, torch.Tensor], ...]:
    """fp32 master states before and after each of `steps` RL steps (steps+1 states).

    Warm-up: `warmup` supervised AdamW steps at lr 1e-3 on random token sequences,
    then the optimizer switches to `lr` and takes REINFORCE steps on sampled
    rollouts. The returned tuple is cached; do not mutate its tensors.
    """
    return _rl_run(size, lr, seed, warmup).states_after(steps)


def served_pairs(
    size: str = "small", lr: float = 1e-6, steps: int = 3, seed: int = 0, dtype: str = "bf16"
) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Consecutive (base, target) served states from `rl_checkpoints`. `dtype` is a served
    dtype (every floating tensor cast to it) or "fp8-block" (2-D weights as e4m3 with fp32
    128x128 block scales, the rest bf16: protocol/served.py; a pre-quantized checkpoint
    published as-is has the same bits)."""
    if dtype == "fp8-block":
        from patchswarm.protocol.served import serve_state

        states = [serve_state(s, "fp8-block") for s in rl_checkpoints(size, lr, steps, seed)]
        return list(zip(states[:-1], states[1:]))
    tdtype = SERVED_DTYPES[dtype]
    states = [served(s, tdtype) for s in rl_checkpoints(size, lr, steps, seed)]
    return list(zip(states[:-1], states[1:]))


def scaled_served_versions(gib: float, versions: int, seed: int = 0, bf16_changed: float = 0.0075,
                           fp8_changed: float = 0.0005):
    """A served checkpoint of about `gib` GiB and `versions` versions after it, one at a time.

    For sizes no test model reaches on a laptop: the tensor mix and change rates
    of the measurements in DESIGN.md and issue 20, not trained weights. Three
    quarters of the bytes are bf16 matrices (8192 x 4096) of which
    `bf16_changed` of the elements move by 1-2 ulp per version; a quarter are
    fp8 e4m3 matrices (4096 x 4096) with an fp32 scale per 128 x 128 block,
    where `fp8_changed` of the elements and half the scales move; plus bf16 norms.
    Yields (state, changed elements); the state is updated in place, so hold a
    clone to keep a version."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    n_bf16 = max(1, round(gib * 0.75 * (1 << 30) / (8192 * 4096 * 2)))
    n_fp8 = max(1, round(gib * 0.25 * (1 << 30) / (4096 * 4096)))
    for i in range(n_bf16):
        state[f"layers.{i}.mlp.weight"] = (torch.randn(8192, 4096, generator=gen) * 0.02).to(torch.bfloat16)
        state[f"layers.{i}.norm.weight"] = (1 + 0.1 * torch.randn(4096, generator=gen)).to(torch.bfloat16)
    for i in range(n_fp8):
        state[f"layers.{i}.attn.weight"] = (torch.randn(4096, 4096, generator=gen) * 100).to(torch.float8_e4m3fn)
        state[f"layers.{i}.attn.weight_scale_inv"] = torch.rand(32, 32, generator=gen) * 1e-3
    yield state, 0
    int_of = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    for _ in range(versions):
        changed = 0
        for name, t in state.items():
            flat = t.view(int_of[t.element_size()]).view(-1)
            rate = 0.5 if name.endswith("scale_inv") else fp8_changed if t.element_size() == 1 else bf16_changed
            k = max(1, int(flat.numel() * rate))
            pos = torch.randint(0, flat.numel(), (k,), generator=gen).unique()
            step = torch.randint(1, 3, (len(pos),), generator=gen, dtype=flat.dtype)
            flat[pos] += step  # never 0: every drawn position changes
            changed += len(pos)
        yield state, changed
