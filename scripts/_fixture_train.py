"""Training loops for the fixture family: target LM, distilled small draft, EAGLE heads.

All randomness comes from ``torch.manual_seed`` and numpy Generators seeded from
(seed, purpose), so a fixture is a function of the seed.  On CUDA, bf16 autocast
and deterministic algorithms (warn-only) are used; bitwise equality across runs is
only promised on CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from _fixture_data import CorpusSpec, build_prompts, make_batch
from _fixture_models import (
    Eagle3Head,
    EagleHead,
    Preset,
    TrainSchedule,
    unroll_head,
)
from torch import nn

EAGLE_STEP_DECAY = 0.8  # EAGLE3's per-step loss weight decay over the TTT unroll
EAGLE_FEATURE_WEIGHT = 1.0  # EAGLE-1 regresses its output onto the target's next hidden


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    final_loss: float  # mean over the last 10% of steps
    seconds: float
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    extra: dict[str, float | list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seed torch and switch on deterministic kernels, restoring the global flags
    afterwards (the builder also runs inside other processes, e.g. pytest)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        # cuBLAS needs this for deterministic GEMMs; set before the first CUDA matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # cuDNN's SDPA backward fails under torch 2.14 on H200 (CUDNN_STATUS_BAD_PARAM)
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, sched: TrainSchedule, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return sched.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, sched.steps - warmup)
    return sched.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


BatchFn = Callable[[int, int], torch.Tensor]  # (seq_len, batch) -> tokens
LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # tokens -> (loss, CE)


def batch_source(spec: CorpusSpec, seed: int, purpose: int, device: torch.device) -> BatchFn:
    """Deterministic batches from the copy corpus (one numpy stream per purpose)."""
    rng = np.random.default_rng([seed, purpose])

    def make(length: int, size: int) -> torch.Tensor:
        return torch.from_numpy(make_batch(rng, size, length, spec.for_length(length))).to(device)

    return make


class _Trainer:
    def __init__(self, params: list[nn.Parameter], sched: TrainSchedule, loss_fn: LossFn) -> None:
        self.params, self.sched, self.loss_fn = params, sched, loss_fn
        self.opt = torch.optim.AdamW(params, lr=sched.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.losses: list[float] = []

    def step(self, tokens: torch.Tensor, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss, ce = self.loss_fn(tokens)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.losses.append(float(loss.detach()))
        return float(ce.detach())


def run_loop(
    params: list[nn.Parameter],
    sched: TrainSchedule,
    data: BatchFn,
    loss_fn: LossFn,
    vocab_size: int,
    log: Callable[[str], None],
    name: str,
) -> TrainResult:
    """Warm stage (until copying is found), then the main curriculum stage."""
    tr = _Trainer(params, sched, loss_fn)
    t0 = time.time()
    warm_steps, found_at = 0, None
    if sched.min_seq_len and sched.warm_max_steps:
        size = sched.batch_for(sched.min_seq_len, sched.warm_tokens)
        threshold = sched.warm_exit_frac * math.log(vocab_size)
        ema = math.log(vocab_size)
        for i in range(sched.warm_max_steps):
            ce = tr.step(data(sched.min_seq_len, size), sched.lr * min(1.0, (i + 1) / sched.warmup))
            ema = 0.95 * ema + 0.05 * ce
            warm_steps = i + 1
            if i % 100 == 0:
                log(f"[{name}] warm {i + 1} len {sched.min_seq_len} loss {ce:.4f} ema {ema:.3f}")
            if i >= sched.warmup and ema < threshold:
                found_at = warm_steps
                break
        log(f"[{name}] warm stage: {warm_steps} steps, copying found at {found_at}")
    warmup = 0 if warm_steps else sched.warmup
    log_every = max(1, sched.steps // 10)
    for step in range(sched.steps):
        length = sched.seq_len_at(step)
        tr.step(data(length, sched.batch_for(length)), lr_at(step, sched, warmup))
        if step % log_every == 0 or step == sched.steps - 1:
            log(f"[{name}] step {step + 1}/{sched.steps} len {length} loss {tr.losses[-1]:.4f}")
    main = tr.losses[warm_steps:] or tr.losses
    every = max(1, len(tr.losses) // 20)
    return TrainResult(
        steps=len(tr.losses),
        first_loss=tr.losses[0],
        final_loss=float(np.mean(main[-max(1, len(main) // 10) :])),
        seconds=round(time.time() - t0, 2),
        loss_curve=[(i, round(tr.losses[i], 4)) for i in range(0, len(tr.losses), every)],
        extra={"warm_steps": warm_steps, "copying_found_at_warm_step": found_at},
    )


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def train_target(
    model: nn.Module, preset: Preset, seed: int, device: torch.device, log: Callable[[str], None]
) -> TrainResult:
    def loss_fn(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(device):
            loss = lm_loss(model(input_ids=tokens).logits, tokens)
        return loss, loss

    model.train()
    data = batch_source(preset.corpus, seed, purpose=1, device=device)
    result = run_loop(
        list(model.parameters()),
        preset.target_train,
        data,
        loss_fn,
        preset.corpus.vocab_size,
        log,
        "target",
    )
    model.eval()
    return result


def distill_draft(
    draft: nn.Module,
    target: nn.Module,
    preset: Preset,
    seed: int,
    device: torch.device,
    log: Callable[[str], None],
) -> TrainResult:
    """Next-token CE plus KL to the target's distribution (so drafts agree with it)."""

    def loss_fn(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(device):
            with torch.no_grad():
                teacher = target(input_ids=tokens).logits.float()
            student = draft(input_ids=tokens).logits.float()
        log_p = F.log_softmax(student, -1)
        kl = F.kl_div(log_p, F.log_softmax(teacher, -1), log_target=True, reduction="none")
        ce = lm_loss(student, tokens)
        return 0.5 * ce + 0.5 * kl.sum(-1).mean(), ce

    draft.train()
    data = batch_source(preset.corpus, seed, purpose=2, device=device)
    result = run_loop(
        list(draft.parameters()),
        preset.draft_train,
        data,
        loss_fn,
        preset.corpus.vocab_size,
        log,
        "small-draft",
    )
    draft.eval()
    return result


@torch.no_grad()
def target_features(
    target: nn.Module, tokens: torch.Tensor, aux_ids: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final normed hidden, concatenated aux states) exactly as vLLM hands them over.

    vLLM's aux state k is the residual stream entering layer k (k=0: embeddings),
    taken here from forward hooks on the decoder layers.
    """
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for k in aux_ids or []:
        if k == 0:
            continue

        def hook(_m: nn.Module, _i: object, out: object, k: int = k) -> None:
            captured[k] = out[0] if isinstance(out, tuple) else out  # type: ignore[index]

        hooks.append(target.model.layers[k - 1].register_forward_hook(hook))
    try:
        final = target.model(input_ids=tokens).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    if not aux_ids:
        return final, final
    captured[0] = target.model.embed_tokens(tokens)
    return final, torch.cat([captured[k] for k in sorted(aux_ids)], dim=-1)


def eagle_loss(
    head: EagleHead | Eagle3Head,
    target: nn.Module,
    tokens: torch.Tensor,
    unroll: int,
    aux_ids: list[int] | None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
    """Loss of the unrolled head on one batch, per-step CE and top-1 accuracy."""
    final, aux = target_features(target, tokens, aux_ids)
    features = (aux if isinstance(head, Eagle3Head) else final)[:, :-1]
    with torch.no_grad():
        embeds_next = target.model.embed_tokens(tokens)[:, 1:]
    lm_head = head.lm_head if isinstance(head, Eagle3Head) else target.lm_head
    t = tokens.shape[1]
    loss = torch.zeros((), device=tokens.device)
    ces: list[torch.Tensor] = []
    accs: list[float] = []
    for s, (logits_in, nxt) in enumerate(unroll_head(head, embeds_next, features, unroll), 1):
        logits = lm_head(logits_in[:, s - 1 : t - 2]).float()
        gold = tokens[:, s + 1 : t]
        ce = F.cross_entropy(logits.flatten(0, 1), gold.flatten())
        loss = loss + EAGLE_STEP_DECAY ** (s - 1) * ce
        ces.append(ce)
        accs.append(float((logits.argmax(-1) == gold).float().mean()))
        if isinstance(head, EagleHead):
            feat = F.smooth_l1_loss(nxt[:, s - 1 : t - 1].float(), final[:, s:t].float())
            loss = loss + EAGLE_FEATURE_WEIGHT * EAGLE_STEP_DECAY ** (s - 1) * feat
    return loss, ces, accs


def train_eagle(
    head: EagleHead | Eagle3Head,
    target: nn.Module,
    preset: Preset,
    seed: int,
    device: torch.device,
    log: Callable[[str], None],
    aux_ids: list[int] | None = None,
) -> TrainResult:
    """Train a head against the frozen target's hidden states (TTT-style unroll)."""
    last_accs: list[float] = []

    def loss_fn(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(device):
            loss, ces, accs = eagle_loss(head, target, tokens, preset.eagle_unroll, aux_ids)
        last_accs[:] = accs
        return loss, ces[0]

    if isinstance(head, Eagle3Head):  # start from the target's output space
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight)
    head.train()
    purpose = 3 if isinstance(head, EagleHead) else 4
    data = batch_source(preset.corpus, seed, purpose=purpose, device=device)
    result = run_loop(
        list(head.parameters()),
        preset.eagle_train,
        data,
        loss_fn,
        preset.corpus.vocab_size,
        log,
        head.kind,
    )
    head.eval()
    result.extra["last_batch_step_acc"] = [round(a, 4) for a in last_accs]
    return result


@torch.no_grad()
def copy_accuracy(
    model: nn.Module, preset: Preset, seed: int, device: torch.device, n: int = 4
) -> float:
    """Teacher-forced next-token accuracy on the copy continuations the harness uses.

    This is the property the fixtures exist for: predicting these tokens needs
    the prompt's KV.
    """
    seq_len = preset.target_train.seq_len
    max_tokens = min(64, seq_len // 8)
    prompts = build_prompts(
        preset.corpus,
        seed + 7919,
        n,
        seq_len - max_tokens,
        prompts_per_group=1,
        max_tokens=max_tokens,
    )
    hits = total = 0
    for prompt, gold in zip(prompts.base, prompts.expected_copy, strict=True):
        tokens = torch.tensor([prompt + gold], device=device)
        with autocast(device):
            pred = model(input_ids=tokens).logits[0, len(prompt) - 1 : -1].argmax(-1)
        hits += int((pred == torch.tensor(gold, device=device)).sum())
        total += len(gold)
    return hits / total
