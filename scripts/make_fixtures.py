#!/usr/bin/env python
"""Build the KV-sensitive fixture model family that vLLM 0.33 loads from local dirs.

    python scripts/make_fixtures.py --out models/fixtures --preset tiny   # CPU, seconds
    python scripts/make_fixtures.py --out /root/fixtures --preset gpu     # one H100, minutes

Writes ``OUT/{target,self-draft,small-draft,eagle,eagle3}``, each with
``fixture_meta.json`` (seed, steps, losses, preset, how it was made), and
``OUT/fixtures.json`` (an index).  See docs/fixtures.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helper modules

import torch  # noqa: E402
from _fixture_data import build_tokenizer  # noqa: E402
from _fixture_models import (  # noqa: E402
    PRESETS,
    Eagle3Head,
    EagleHead,
    LlamaShape,
    Preset,
    eagle3_aux_layer_ids,
    llama_config,
)
from _fixture_train import (  # noqa: E402
    TrainResult,
    copy_accuracy,
    deterministic,
    distill_draft,
    pick_device,
    train_eagle,
    train_target,
)

FIXTURES: tuple[str, ...] = ("target", "self-draft", "small-draft", "eagle", "eagle3")
META_FILE = "fixture_meta.json"
INDEX_FILE = "fixtures.json"
# vLLM ``speculative_config.method`` for each drafter fixture
SPEC_METHOD: dict[str, str] = {
    "self-draft": "draft_model",
    "small-draft": "draft_model",
    "eagle": "eagle",
    "eagle3": "eagle3",
}
# the preset schedule each trained fixture follows
SCHEDULE: dict[str, str] = {
    "target": "target_train",
    "small-draft": "draft_train",
    "eagle": "eagle_train",
    "eagle3": "eagle_train",
}


def resolve_preset(name: str, max_steps: int | None = None) -> Preset:
    """The named preset, with every schedule capped at ``max_steps`` (tests, smoke runs)."""
    preset = PRESETS[name]
    if max_steps is None:
        return preset
    cap = {
        f: replace(
            s,
            steps=min(s.steps, max_steps),
            warmup=min(s.warmup, max(1, max_steps // 4)),
            warm_max_steps=min(s.warm_max_steps, max_steps),
        )
        for f in SCHEDULE.values()
        if (s := getattr(preset, f))
    }
    return replace(preset, **cap)


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _meta(
    name: str, preset: Preset, seed: int, how: str, result: TrainResult | None, **extra: object
) -> dict[str, object]:
    return {
        "fixture": name,
        "spec_method": SPEC_METHOD.get(name),
        "preset": preset.name,
        "seed": seed,
        "how": how,
        "made_by": "scripts/make_fixtures.py",
        "steps": result.steps if result else 0,
        "first_loss": result.first_loss if result else None,
        "final_loss": result.final_loss if result else None,
        "train_seconds": result.seconds if result else 0.0,
        "loss_curve": result.loss_curve if result else [],
        "train_extra": result.extra if result else {},
        "device": str(pick_device()),
        "versions": _versions(),
        "corpus": preset.corpus.to_dict(),
        "schedule": asdict(getattr(preset, SCHEDULE[name])) if name in SCHEDULE else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def _write_meta(directory: Path, meta: dict[str, object]) -> None:
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _save_tokenizer(directory: Path, preset: Preset) -> None:
    build_tokenizer(preset.corpus.vocab_size, preset.max_position).save_pretrained(directory)


def save_lm(
    model: torch.nn.Module, directory: Path, preset: Preset, meta: dict[str, object]
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.to("cpu", torch.float32).save_pretrained(directory, safe_serialization=True)
    _save_tokenizer(directory, preset)
    _write_meta(directory, meta)


def save_head(
    head: EagleHead | Eagle3Head,
    config: object,
    directory: Path,
    preset: Preset,
    meta: dict[str, object],
) -> None:
    """config.json + model.safetensors with the names vLLM's EAGLE loaders expect."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)  # type: ignore[attr-defined]
    tensors = {
        k: v.detach().to("cpu", torch.float32).contiguous()
        for k, v in head.state_dict_for_vllm().items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _save_tokenizer(directory, preset)
    _write_meta(directory, meta)


def new_llama(shape: LlamaShape, preset: Preset, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    cfg = llama_config(shape, preset)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(device, torch.float32)


def build_fixtures(
    out: Path,
    seed: int = 0,
    preset_name: str = "tiny",
    max_steps: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, object]]:
    """Train and save all fixtures under ``out``; returns {fixture: meta}."""
    preset = resolve_preset(preset_name, max_steps)
    with deterministic(seed):
        builder = _Builder(out, seed, preset, log)
        target = builder.target()
        builder.self_draft()
        builder.small_draft(target)
        for p in target.parameters():  # frozen teacher for the heads
            p.requires_grad_(False)
        builder.eagle(target)
        builder.eagle3(target)
        builder.write_index()
        return builder.metas


class _Builder:
    """One method per fixture; each trains, saves and records its meta."""

    def __init__(self, out: Path, seed: int, preset: Preset, log: Callable[[str], None]) -> None:
        self.out, self.seed, self.preset, self.log = out, seed, preset, log
        self.device = pick_device()
        self.metas: dict[str, dict[str, object]] = {}
        self.head_shape = replace(preset.target, num_layers=1)  # heads: target geometry
        self.eagle_shape = replace(preset.target, num_layers=preset.eagle_layers)
        out.mkdir(parents=True, exist_ok=True)
        log(f"building fixtures preset={preset.name} seed={seed} device={self.device} out={out}")

    def _torch_seed(self, k: int) -> None:
        torch.manual_seed(self.seed * 1000 + k)  # own init stream per fixture

    def target(self) -> torch.nn.Module:
        p = self.preset
        self._torch_seed(1)
        target = new_llama(p.target, p, self.device)
        res = train_target(target, p, self.seed, self.device, self.log)
        acc = copy_accuracy(target, p, self.seed, self.device)
        how = "Llama trained from scratch on the synthetic copy corpus"
        meta = _meta("target", p, self.seed, how, res, shape=asdict(p.target), copy_acc=acc)
        save_lm(target, self.out / "target", p, meta)
        self.metas["target"] = meta
        return target.to(self.device)

    def self_draft(self) -> None:
        shutil.copytree(self.out / "target", self.out / "self-draft", dirs_exist_ok=True)
        how = "byte copy of target (draft_model self-speculation)"
        meta = _meta(
            "self-draft", self.preset, self.seed, how, None,
            shape=asdict(self.preset.target), copy_of="target",
            copy_acc=self.metas["target"]["copy_acc"],
        )  # fmt: skip
        _write_meta(self.out / "self-draft", meta)
        self.metas["self-draft"] = meta

    def small_draft(self, target: torch.nn.Module) -> None:
        p = self.preset
        self._torch_seed(2)
        draft = new_llama(p.small_draft, p, self.device)
        res = distill_draft(draft, target, p, self.seed, self.device, self.log)
        acc = copy_accuracy(draft, p, self.seed, self.device)
        how = "smaller Llama (fewer KV heads), CE + KL distilled from target"
        meta = _meta(
            "small-draft", p, self.seed, how, res, shape=asdict(p.small_draft), copy_acc=acc
        )
        save_lm(draft, self.out / "small-draft", p, meta)
        self.metas["small-draft"] = meta

    def eagle(self, target: torch.nn.Module) -> None:
        p = self.preset
        self._torch_seed(3)
        head = EagleHead(self.eagle_shape).to(self.device)
        res = train_eagle(head, target, p, self.seed, self.device, self.log)
        cfg = llama_config(self.eagle_shape, p, architectures=["EagleLlamaForCausalLM"])
        how = (
            f"EAGLE-1 head (fc + {p.eagle_layers} layers, shares the target's embed/lm_head), "
            "trained on the target's final hidden states"
        )
        meta = _meta(
            "eagle", p, self.seed, how, res, shape=asdict(self.eagle_shape), unroll=p.eagle_unroll
        )
        save_head(head, cfg, self.out / "eagle", p, meta)
        self.metas["eagle"] = meta

    def eagle3(self, target: torch.nn.Module) -> None:
        p = self.preset
        aux_ids = eagle3_aux_layer_ids(p.target.num_layers)
        self._torch_seed(4)
        head = Eagle3Head(self.head_shape, p.corpus.vocab_size, num_aux=len(aux_ids))
        head = head.to(self.device)
        res = train_eagle(head, target, p, self.seed, self.device, self.log, aux_ids=aux_ids)
        cfg = llama_config(
            self.head_shape,
            p,
            architectures=["Eagle3LlamaForCausalLM"],
            draft_vocab_size=p.corpus.vocab_size,  # full vocab: no d2t/t2d tables
            target_hidden_size=p.target.hidden,
            eagle_aux_hidden_state_layer_ids=aux_ids,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": aux_ids,
                "use_aux_hidden_state": True,
            },
        )
        how = (
            "EAGLE3 head (fc over 3 aux states + 1 layer + own lm_head), "
            "trained on the target's aux hidden states"
        )
        meta = _meta(
            "eagle3", p, self.seed, how, res, shape=asdict(self.head_shape),
            unroll=p.eagle_unroll, eagle_aux_hidden_state_layer_ids=aux_ids,
        )  # fmt: skip
        save_head(head, cfg, self.out / "eagle3", p, meta)
        self.metas["eagle3"] = meta

    def write_index(self) -> None:
        index = {
            "preset": self.preset.to_dict(),
            "seed": self.seed,
            "fixtures": {k: str(self.out / k) for k in FIXTURES},
        }
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument(
        "--max-steps", type=int, default=None, help="cap every training schedule (smoke runs)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    metas = build_fixtures(
        args.out, args.seed, args.preset, args.max_steps, log=lambda s: print(s, flush=True)
    )
    for name, meta in metas.items():
        loss, acc = meta["final_loss"], meta.get("copy_acc")
        print(f"{name:12s} steps={meta['steps']:5d} final_loss={loss} copy_acc={acc}")
    print(f"done in {time.time() - t0:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
