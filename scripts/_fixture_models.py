"""Fixture model shapes and the EAGLE / EAGLE3 heads, written to match vLLM 0.33.

The heads are plain torch modules whose forward math and parameter names mirror
``vllm/model_executor/models/llama_eagle.py`` (EAGLE-1) and ``llama_eagle3.py``
(EAGLE3), so that a head trained here and saved with :meth:`state_dict_for_vllm`
loads into vLLM's ``EagleLlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from _fixture_data import BOS_ID, EOS_ID, PAD_ID, CorpusSpec
from torch import nn

ROPE_THETA = 1_000_000.0  # large base: content lookups stay usable at long range
RMS_EPS = 1e-5


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    def __post_init__(self) -> None:
        # vLLM's CPU attention needs head_dim >= 32; GQA needs heads % kv_heads == 0
        if self.head_dim < 32 or self.heads % self.kv_heads or self.kv_heads < 1:
            raise ValueError(f"unsupported attention geometry {self}")


@dataclass(frozen=True)
class TrainSchedule:
    """Optimizer schedule with a short-sequence warm stage and a length curriculum.

    Small models find copying (an induction circuit) only after a plateau, and
    much sooner on short sequences.  So training first runs a *warm stage* on
    ``min_seq_len``-token sequences (constant lr, at most ``warm_max_steps`` steps)
    that ends as soon as the running next-token loss falls below
    ``warm_exit_frac * ln(vocab)`` (copying found).  Then ``steps`` main steps double
    the length in stages up to ``seq_len`` with a cosine lr, at ``batch * seq_len``
    tokens per step.
    """

    steps: int
    batch: int  # sequences per step at the full seq_len
    seq_len: int
    lr: float
    warmup: int
    min_seq_len: int = 0  # 0: no warm stage and no curriculum
    warm_max_steps: int = 0
    warm_tokens: int = 0  # tokens per warm step; 0: batch * seq_len
    warm_exit_frac: float = 0.75

    def seq_len_at(self, step: int) -> int:
        """Main-stage length: min_seq_len * 2, * 4, ... up to seq_len in even stages,
        the full length getting at least the last 40% of the steps."""
        first = 2 * self.min_seq_len
        if not self.min_seq_len or first >= self.seq_len:
            return self.seq_len
        stages = math.ceil(math.log2(self.seq_len / first)) + 1
        stage = min(stages - 1, int(step / (0.6 * self.steps / (stages - 1))))
        return min(self.seq_len, first * 2**stage)

    def batch_for(self, length: int, tokens: int = 0) -> int:
        return max(1, (tokens or self.batch * self.seq_len) // length)


@dataclass(frozen=True)
class Preset:
    name: str
    corpus: CorpusSpec
    max_position: int
    target: LlamaShape
    small_draft: LlamaShape
    target_train: TrainSchedule
    draft_train: TrainSchedule
    eagle_train: TrainSchedule
    eagle_unroll: int  # draft steps simulated while training EAGLE heads (TTT)
    dtype: str  # dtype recorded in config.json (what vLLM's dtype="auto" picks)
    eagle_layers: int = 2  # EAGLE-1 head depth (see EagleHead); EAGLE3 has one layer

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


PRESETS: dict[str, Preset] = {
    # Seconds on a laptop CPU: exercises every code path, learns little.
    "tiny": Preset(
        name="tiny",
        corpus=CorpusSpec(vocab_size=256, min_span=4, max_span=12, min_copy=8, max_copy=48),
        max_position=2048,
        target=LlamaShape(2, 64, 2, 2, 32, 128),
        small_draft=LlamaShape(1, 32, 1, 1, 32, 64),  # 1 KV head vs the target's 2
        target_train=TrainSchedule(steps=30, batch=8, seq_len=128, lr=3e-3, warmup=5),
        draft_train=TrainSchedule(steps=20, batch=8, seq_len=128, lr=3e-3, warmup=5),
        eagle_train=TrainSchedule(steps=20, batch=8, seq_len=128, lr=3e-3, warmup=5),
        eagle_unroll=2,
        dtype="float32",
    ),
    # ~10 minutes on a 2-core CPU: learns copying; for CPU end-to-end acceptance checks.
    "cpu": Preset(
        name="cpu",
        corpus=CorpusSpec(
            vocab_size=512, min_span=4, max_span=16, p_copy=0.75, min_copy=8, max_copy=128
        ),
        max_position=4096,
        target=LlamaShape(2, 128, 4, 2, 32, 256),
        small_draft=LlamaShape(2, 64, 2, 1, 32, 128),  # 1 KV head vs the target's 2
        target_train=TrainSchedule(
            600, 8, 512, 1e-3, 30, 64, warm_max_steps=2500, warm_tokens=2048
        ),
        draft_train=TrainSchedule(400, 8, 512, 1e-3, 30, 64, warm_max_steps=1500, warm_tokens=2048),
        eagle_train=TrainSchedule(300, 4, 512, 1e-3, 30, 64, warm_max_steps=1500, warm_tokens=2048),
        eagle_unroll=3,
        dtype="float32",
    ),
    # Minutes on one H100: copies long spans out of 2k-8k token contexts.
    "gpu": Preset(
        name="gpu",
        corpus=CorpusSpec(
            vocab_size=4096, min_span=4, max_span=16, p_copy=0.75, min_copy=8, max_copy=256
        ),
        max_position=32768,
        target=LlamaShape(4, 256, 4, 2, 64, 1024),
        small_draft=LlamaShape(2, 128, 2, 1, 64, 512),  # 1 KV head vs the target's 2
        # warm steps (64-token rows) are cheap on a GPU: a generous budget makes
        # finding copying, the one thing that can fail, all but certain
        target_train=TrainSchedule(
            1200, 8, 4096, 1e-3, 100, 64, warm_max_steps=8000, warm_tokens=16384
        ),
        draft_train=TrainSchedule(
            800, 8, 4096, 1e-3, 100, 64, warm_max_steps=5000, warm_tokens=16384
        ),
        eagle_train=TrainSchedule(
            500, 4, 4096, 1e-3, 50, 64, warm_max_steps=5000, warm_tokens=16384
        ),
        eagle_unroll=3,
        dtype="bfloat16",
    ),
}


def llama_config(shape: LlamaShape, preset: Preset, **extra: object):  # -> LlamaConfig
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=preset.corpus.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=preset.max_position,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_EPS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        **extra,
    )
    cfg.dtype = preset.dtype
    return cfg


def eagle3_aux_layer_ids(num_target_layers: int) -> list[int]:
    """Three distinct aux layers, low / middle / high, as EAGLE3 uses them.

    vLLM collects aux state ``k`` as the residual stream entering target layer ``k``
    (``k == 0``: embeddings, ``k == N``: output of the last layer, before the norm).
    vLLM's default (2, N//2, N-3) collapses for shallow targets, so the fixture
    always writes the ids into its config.
    """
    n = num_target_layers
    ids = [1, n // 2, n - 1] if n >= 4 else [0, 1, 2]
    if len(set(ids)) != 3 or max(ids) > n:
        raise ValueError(f"need a target with >= 2 layers for EAGLE3, got {n}")
    return ids


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = RMS_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Neox-style rotary tables, as vLLM's default rotary embedding for Llama."""
    inv_freq = 1.0 / (
        ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    )
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """GQA attention split into qkv / attend so the TTT unroll can reuse keys."""

    def __init__(self, in_dim: int, hidden: int, shape: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.q_proj = nn.Linear(in_dim, shape.heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, shape.kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, shape.kv_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.heads * shape.head_dim, hidden, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One Llama decoder layer (HF parameter names).

    EAGLE-1's first layer has no input norm (vLLM swaps it for Identity); EAGLE3's
    layer adds ``hidden_norm`` and attends over a 2H-wide input.
    """

    def __init__(self, shape: LlamaShape, attn_in: int, input_norm: bool, eagle3: bool) -> None:
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(shape.hidden)
        if eagle3:
            self.hidden_norm = RMSNorm(shape.hidden)
        self.self_attn = Attention(attn_in, shape.hidden, shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden)
        self.mlp = MLP(shape.hidden, shape.intermediate)

    def after_attn(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """vLLM's fused add + post-attention norm, then the MLP: (mlp_out, residual)."""
        residual = attn_out + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


Pair = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- heads


class EagleHead(nn.Module):
    """EAGLE-1 head as in vLLM ``llama_eagle.py``.

    x = fc(cat(embed(tok_{i+1}), h_i)) runs through ``shape.num_layers`` decoder
    layers (the first without input norm); output = mlp_out + residual, with no
    final norm, feeds the *target's* lm_head and is the next step's hidden state.
    The checkpoint has no embed_tokens / lm_head, so vLLM shares the target's.

    Two layers by default: with one, the head would have to read the current
    token's identity out of the target's final hidden state to copy, which small
    heads learn very slowly; a second layer gets it from the previous position,
    as an induction head does.
    """

    kind = "eagle"

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * shape.hidden, shape.hidden, bias=False)
        self.layers = nn.ModuleList(
            DraftLayer(shape, shape.hidden, input_norm=i > 0, eagle3=False)
            for i in range(shape.num_layers)
        )

    def project_target(self, features: torch.Tensor) -> torch.Tensor:
        return features  # EAGLE-1 consumes the target's final (normed) hidden state

    def begin(self, embeds: torch.Tensor, hidden: torch.Tensor) -> Pair:
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return x, torch.zeros_like(x)  # (stream, residual)

    def attn_input(
        self, i: int, x: torch.Tensor, residual: torch.Tensor, embeds: torch.Tensor
    ) -> Pair:
        if i == 0:
            return x, x  # Identity input norm; residual starts as the fc output
        residual = x + residual
        return self.layers[i].input_layernorm(residual), residual

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        out = x + residual
        return out, out  # (logits input, next-step hidden)

    def state_dict_for_vllm(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


class Eagle3Head(nn.Module):
    """EAGLE3 head as in vLLM ``llama_eagle3.py`` (norm_before_residual=False).

    g = fc(cat(aux states)); e = input_layernorm(embed(tok)); attention over
    cat(e, hidden_norm(g)) with residual g; prenorm = mlp_out + residual is the
    next-step hidden; logits = lm_head(norm(prenorm)).  Saved with the original
    EAGLE3 names (``midlayer.*``), which vLLM maps to ``layers.0.*``.
    """

    kind = "eagle3"

    def __init__(self, shape: LlamaShape, vocab_size: int, num_aux: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(num_aux * shape.hidden, shape.hidden, bias=False)
        self.midlayer = DraftLayer(shape, 2 * shape.hidden, input_norm=True, eagle3=True)
        self.norm = RMSNorm(shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, vocab_size, bias=False)

    @property
    def layers(self) -> list[DraftLayer]:
        return [self.midlayer]

    def project_target(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)  # vLLM: combine_hidden_states, once per propose()

    def begin(self, embeds: torch.Tensor, hidden: torch.Tensor) -> Pair:
        return hidden, hidden

    def attn_input(
        self, i: int, x: torch.Tensor, residual: torch.Tensor, embeds: torch.Tensor
    ) -> Pair:
        e = self.midlayer.input_layernorm(embeds)
        return torch.cat([e, self.midlayer.hidden_norm(x)], dim=-1), x

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        prenorm = x + residual
        return self.norm(prenorm), prenorm

    def state_dict_for_vllm(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def ttt_mask(seq_len: int, step: int, device: torch.device) -> torch.Tensor:
    """Attention mask of draft step ``step`` (1-based) over keys of steps 1..step.

    At inference the step-s draft token at position j has base position
    p = j - s + 1: it sees step-1 KV at positions <= p and, for t = 2..s, the
    step-t KV at position p + t - 1 (one key per earlier draft step).
    """
    j = torch.arange(seq_len, device=device).unsqueeze(1)
    k = torch.arange(seq_len, device=device).unsqueeze(0)
    blocks = [k <= j - step + 1]
    blocks += [k == j - step + t for t in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def unroll_head(
    head: EagleHead | Eagle3Head,
    embeds_next: torch.Tensor,
    target_features: torch.Tensor,
    steps: int,
) -> list[Pair]:
    """Run ``steps`` draft steps over a whole sequence (training-time test).

    ``embeds_next[:, i]`` is the embedding of token i+1; step 1 gets the target's
    features at i, step s > 1 gets the previous step's output at i-1.  Returns
    (logits input, next hidden) per step.  Every step's output at position j
    predicts ``tokens[:, j + 2]``; for step s it is meaningful from j = s - 1 on.
    """
    t = embeds_next.shape[1]
    cos, sin = rope_cos_sin(t, head.layers[0].self_attn.head_dim, embeds_next.device)
    hidden = head.project_target(target_features)
    kv: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in head.layers]
    outs: list[Pair] = []
    for s in range(1, steps + 1):
        if s > 1:
            hidden = F.pad(outs[-1][1][:, :-1], (0, 0, 1, 0))  # shift right by one
        mask = ttt_mask(t, s, hidden.device)
        x, residual = head.begin(embeds_next, hidden)
        for i, layer in enumerate(head.layers):
            a, residual = head.attn_input(i, x, residual, embeds_next)
            q, k, v = layer.self_attn.qkv(a, cos, sin)
            kv[i][0].append(k)
            kv[i][1].append(v)
            out = layer.self_attn.attend(
                q, torch.cat(kv[i][0], dim=2), torch.cat(kv[i][1], dim=2), mask
            )
            x, residual = layer.after_attn(out, residual)
        outs.append(head.finish(x, residual))
    return outs
