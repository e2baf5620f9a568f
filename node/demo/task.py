"""The demo's policy, its task with a verifiable reward, rollouts and the trainer's update.

Owns: a small causal transformer policy (`Policy`, fp32 master weights), its
"pretrained" starting point (`pretrained_policy`: a short supervised warm-up
on a corpus that teaches the task's format, not its goal), the task
(`score`: how sorted the generated digits are, computed from the tokens
alone), `rollout` (sampling with the served weights cast up to fp32) and
`train_step` (one policy-gradient update from a batch of trajectories).
Trajectories cross process boundaries as msgpack (`encode_trajectory` /
`decode_trajectory`).

Must not do I/O (no sockets, files or clocks other than timing the step): the
rollout worker and the demo orchestrator own that.

The task: after the prompt [BOS, SORT] the policy writes GEN_LEN tokens; the
reward is the fraction of adjacent pairs that are two digits in strictly
increasing order. The warm-up shows the format, mostly with digits in random
order (reward ~0.5 at the start); RL has to make "ascending" the habit.

Why the configuration looks the way it does: patchswarm ships the *served*
bf16 weights as a patch of the elements whose bf16 value changed. An Adam step
moves every element that has a gradient by up to about the learning rate, and
a bf16 element changes when its fp32 master crosses a rounding boundary (the
ulp is 2^-8..2^-7 of its magnitude), so the changed fraction grows with
lr / |w|. A policy that must visibly learn in ~30 steps needs an lr far above
real RL lrs (1e-6..1e-5): at lr 3e-4 half of the transformer body's bf16
elements change every step. What keeps the patch ~16x below the checkpoint
(measured by `python -m patchswarm.node.demo.learner`, 30 steps):
  - a pretrained-LM shape: a 4096-token vocabulary with untied input and
    output embeddings (72 % of the parameters; the task uses 12 tokens).
    Input rows of tokens no rollout samples get no gradient (fresh RL
    optimizer, no weight decay): ~1 % of them change per step. Output rows
    get tiny softmax gradients;
  - Adam eps 1e-5 (the PPO setting of Stable-Baselines3 and CleanRL; LLM RL
    stacks mostly keep torch's 1e-8): tiny gradients stay tiny steps instead
    of being normalized up to a full lr step. Unused output rows: 8 % changed
    per step with 1e-5, 50 % with 1e-8 (full/patch 16x against 11x);
  - LeCun-scaled weights (std 1/sqrt(fan_in)), as a model of this width has.
Lower lr, smaller patches, slower learning: lr 5e-5 gives 45x and reward
0.47 -> 0.55 in 30 steps; lr 1.5e-4 23x, 0.47 -> 0.74; lr 3e-4 16x,
0.47 -> 0.83; lr 5e-4 13x, 0.48 -> 0.92.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Iterable, Sequence

import msgpack
import torch
from torch import nn
from torch.nn import functional as F

from patchswarm.protocol.errors import CorruptData

BOS = 0
SORT = 1
DIGIT0 = 2
DIGITS = 10
PROMPT = (BOS, SORT)
GEN_LEN = 8
TRAJECTORY_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """Shape of the policy. The vocabulary is much larger than the task's 12
    tokens, as in a pretrained LM: rows of tokens RL never samples get no
    gradient in the input embedding."""

    vocab: int = 4096
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    ff: int = 512
    max_len: int = len(PROMPT) + GEN_LEN
    tied: bool = False  # untied, as in Llama/Mistral; tied rows would take the output gradient too


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The trainer's optimizer and loss settings."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-5  # PPO's usual Adam eps: tiny gradients stay tiny steps (see above)
    weight_decay: float = 0.0
    is_clip: float = 2.0  # truncated importance weight for slightly stale rollouts
    max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class Pretraining:
    """The supervised warm-up that stands in for pretraining + SFT: the
    corpus shows the task's format, digits in random order except a
    `sorted_fraction` of ascending examples (a latent skill RL can amplify),
    and generic text over the whole vocabulary."""

    steps: int = 150
    batch: int = 32
    lr: float = 2e-3
    sorted_fraction: float = 0.35


DEFAULT_SPEC = PolicySpec()
DEFAULT_RL = RLConfig()
DEFAULT_PRETRAINING = Pretraining()


class Block(nn.Module):
    def __init__(self, s: PolicySpec):
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.d_model)
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model)
        self.proj = nn.Linear(s.d_model, s.d_model)
        self.ln2 = nn.LayerNorm(s.d_model)
        self.fc1 = nn.Linear(s.d_model, s.ff)
        self.fc2 = nn.Linear(s.ff, s.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Policy(nn.Module):
    """A GPT-style causal LM; logits for the next token at every position."""

    def __init__(self, s: PolicySpec = DEFAULT_SPEC):
        super().__init__()
        self.spec = s
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Embedding(s.max_len, s.d_model)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d_model)
        self.head = None if s.tied else nn.Linear(s.d_model, s.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # LeCun normal: std 1/sqrt(fan_in); embeddings as if their fan-in were d_model.
                nn.init.normal_(p, std=(p.shape[-1] if name.startswith("blocks") else s.d_model) ** -0.5)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Logits for positions `first`.. (the vocabulary projection is most
        of the cost, so callers ask only for the positions they use)."""
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        h = self.ln_f(x[:, first:])
        return h @ self.embed.weight.T if self.head is None else self.head(h)


def master_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the fp32 master weights (what the trainer publishes)."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def served_state(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The served copy: each floating tensor cast (round to nearest) to `dtype`."""
    return {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach().clone()).contiguous()
            for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- the task


def score(tokens: Sequence[int]) -> float:
    """Reward in [0, 1] from the tokens alone: the fraction of adjacent pairs
    of the generated part that are two digits in strictly increasing order.
    A non-digit token breaks the pairs it is in."""
    gen = list(tokens[len(PROMPT):])
    if len(gen) < 2:
        return 0.0
    good = sum(1 for a, b in zip(gen, gen[1:])
               if DIGIT0 <= a < DIGIT0 + DIGITS and DIGIT0 <= b < DIGIT0 + DIGITS and a < b)
    return good / (len(gen) - 1)


def _score_batch(gen: torch.Tensor) -> torch.Tensor:
    """`score` for a (batch, GEN_LEN) tensor of generated tokens, vectorized."""
    is_digit = (gen >= DIGIT0) & (gen < DIGIT0 + DIGITS)
    return (is_digit[:, 1:] & is_digit[:, :-1] & (gen[:, 1:] > gen[:, :-1])).float().mean(1)


def _warmup_batch(spec: PolicySpec, n: int, sorted_fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A batch of the warm-up corpus (see `Pretraining`)."""
    task = torch.randint(DIGIT0, DIGIT0 + DIGITS, (n // 2, GEN_LEN), generator=gen)
    k = int(sorted_fraction * (n // 2))
    task[:k] = task[:k].sort(1).values
    task = torch.cat([torch.tensor(PROMPT).expand(n // 2, -1), task], 1)
    text = torch.randint(DIGIT0, spec.vocab, (n - n // 2, spec.max_len - 1), generator=gen)
    text = torch.cat([torch.full((n - n // 2, 1), BOS), text], 1)
    return torch.cat([task, text], 0)


@functools.lru_cache(maxsize=4)
def _pretrained_state(spec: PolicySpec, pre: Pretraining, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Policy(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=pre.lr, weight_decay=0.01)
    for _ in range(pre.steps):
        data = _warmup_batch(spec, pre.batch, pre.sorted_fraction, gen)
        loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return master_state(model)


def pretrained_policy(spec: PolicySpec = DEFAULT_SPEC, pre: Pretraining = DEFAULT_PRETRAINING,
                      seed: int = 0) -> Policy:
    """A fresh `Policy` with the warmed-up weights (deterministic for a seed
    on one torch build; the warm-up runs once per process and is cached)."""
    model = Policy(spec)
    model.load_state_dict(_pretrained_state(spec, pre, seed))
    return model


def make_optimizer(model: nn.Module, cfg: RLConfig = DEFAULT_RL) -> torch.optim.Optimizer:
    """The RL stage's own optimizer (fresh moments, as when RL starts from a
    pretrained checkpoint)."""
    return torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)


# ---------------------------------------------------------------- rollouts


@functools.lru_cache(maxsize=2)
def _sampler(spec: PolicySpec) -> Policy:
    return Policy(spec).eval()


def policy_from_served(weights: dict[str, torch.Tensor], spec: PolicySpec = DEFAULT_SPEC) -> Policy:
    """A per-process policy module holding `weights` cast up to fp32."""
    model = _sampler(spec)
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model


@torch.no_grad()
def rollout(weights: dict[str, torch.Tensor], n: int, seed: int, spec: PolicySpec = DEFAULT_SPEC) -> list[dict]:
    """Sample `n` completions of the prompt with the served `weights` (any
    float dtype, computed in fp32) and score them.

    Returns trajectory dicts, msgpack-able: `tokens` (prompt + completion),
    `logprobs` (behavior log-probability of each generated token) and
    `reward`. Deterministic for (weights, n, seed) on one torch build.
    """
    model = policy_from_served(weights, spec)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(PROMPT).expand(n, -1).contiguous()
    logps = []
    for _ in range(GEN_LEN):
        logits = torch.log_softmax(model(tokens, first=tokens.shape[1] - 1)[:, -1], -1)
        nxt = torch.multinomial(logits.exp(), 1, generator=gen)
        logps.append(logits.gather(1, nxt))
        tokens = torch.cat([tokens, nxt], 1)
    rewards = _score_batch(tokens[:, len(PROMPT):])
    lp = torch.cat(logps, 1)
    return [{"tokens": tokens[i].tolist(), "logprobs": lp[i].tolist(), "reward": float(rewards[i])}
            for i in range(n)]


def encode_trajectory(traj: dict) -> bytes:
    """The wire form of a trajectory (msgpack), as workers submit it."""
    return msgpack.packb({"v": TRAJECTORY_VERSION, "tokens": traj["tokens"], "logprobs": traj["logprobs"],
                          "reward": traj["reward"]}, use_bin_type=True)


def decode_trajectory(payload: bytes, spec: PolicySpec = DEFAULT_SPEC) -> dict:
    """Parse and check a submitted trajectory; raises CorruptData on anything else."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CorruptData(f"trajectory: expected msgpack, found undecodable bytes ({type(e).__name__})") from None
    if not isinstance(obj, dict) or obj.get("v") != TRAJECTORY_VERSION:
        raise CorruptData(f"trajectory: expected a map with v={TRAJECTORY_VERSION}, found {str(obj)[:80]}")
    toks, lps = obj.get("tokens"), obj.get("logprobs")
    ok = (isinstance(toks, list) and len(toks) == len(PROMPT) + GEN_LEN and tuple(toks[:len(PROMPT)]) == PROMPT
          and all(isinstance(t, int) and 0 <= t < spec.vocab for t in toks)
          and isinstance(lps, list) and len(lps) == GEN_LEN and all(isinstance(x, float) for x in lps)
          and isinstance(obj.get("reward"), float))
    if not ok:
        raise CorruptData(f"trajectory: expected prompt {list(PROMPT)} + {GEN_LEN} tokens < {spec.vocab}, "
                          f"{GEN_LEN} float logprobs and a float reward, found {str(obj)[:120]}")
    return {"tokens": toks, "logprobs": lps, "reward": obj["reward"]}


# ---------------------------------------------------------------- the update


def train_step(model: Policy, optimizer: torch.optim.Optimizer, trajectories: Iterable[dict],
               cfg: RLConfig = DEFAULT_RL) -> dict:
    """One policy-gradient step (REINFORCE, group-normalized advantage,
    token-level truncated importance weights for rollouts made by an older
    version or by the bf16 copy).

    The reward is recomputed from the tokens (it is verifiable; the worker's
    number is only compared). Returns metrics: n, reward_mean, reward_std,
    reward_mismatch, loss, is_weight_mean, grad_norm, seconds.
    """
    t0 = time.perf_counter()
    trajs = list(trajectories)
    if not trajs:
        raise ValueError("train_step: expected at least one trajectory, found none")
    tokens = torch.tensor([t["tokens"] for t in trajs])
    old = torch.tensor([t["logprobs"] for t in trajs])
    r = _score_batch(tokens[:, len(PROMPT):])
    claimed = torch.tensor([t["reward"] for t in trajs])
    adv = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6))[:, None]
    model.train()
    logits = model(tokens[:, :-1], first=len(PROMPT) - 1)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, len(PROMPT):, None])[..., 0]
    w = torch.exp(lp.detach() - old).clamp(max=cfg.is_clip)
    loss = -(w * adv * lp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return {
        "n": len(trajs),
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "reward_mismatch": int((claimed - r).abs().gt(1e-6).sum()),
        "loss": loss.item(),
        "is_weight_mean": float(w.mean()),
        "grad_norm": float(gnorm) if math.isfinite(float(gnorm)) else float("nan"),
        "seconds": time.perf_counter() - t0,
    }
