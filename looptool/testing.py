"""Tiny random-config Hugging Face models for tests, examples and benchmarks.

Each entry builds a real ``transformers`` model of the named ``model_type`` with hidden
size 64 and a handful of layers, so the whole pipeline runs on real architectures in
seconds (the mergekit approach: build tiny real models on the fly).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from looptool.core.errors import LooptoolError
from looptool.core.words import counted
from looptool.engine.outputs import GenerationOutput
from looptool.engine.sampling import GREEDY, SamplingParams, TokenPicker
from looptool.runtime.adaptive import AutoDepth, check_auto_policy
from looptool.runtime.decode_graphs import adaptive_path, allocate_cache
from looptool.runtime.network import LoopedNetwork

_COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
_MOE = dict(num_experts_per_tok=2, intermediate_size=96)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, intermediate_size=128),
    "mistral": dict(_COMMON, intermediate_size=128),
    "qwen2": dict(_COMMON, intermediate_size=128),
    "qwen3": dict(_COMMON, intermediate_size=128, head_dim=16),
    "gemma3_text": dict(
        _COMMON,
        intermediate_size=128,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "phi3": dict(_COMMON, intermediate_size=128, pad_token_id=0),
    "gpt2": dict(vocab_size=256, n_embd=64, n_head=4, n_positions=128),
    "gpt_neox": dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        use_parallel_residual=True,
    ),
    "cohere": dict(  # parallel residual summed as h + A(x) + M(x); token ids inside the vocabulary
        _COMMON,
        intermediate_size=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "olmo2": dict(_COMMON, intermediate_size=128),
    "mixtral": dict(_COMMON, num_local_experts=4, **_MOE),
    "qwen3_moe": dict(
        _COMMON,
        num_experts=4,
        moe_intermediate_size=96,
        head_dim=16,
        **_MOE,
    ),
    "olmoe": dict(_COMMON, num_experts=4, **_MOE),
    "qwen2_moe": dict(
        _COMMON,
        num_experts=4,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=96,
        **_MOE,
    ),
}
TINY_MODEL_TYPES = tuple(TINY_CONFIGS)


def tiny_config(model_type: str, num_layers: int = 4, **overrides) -> transformers.PretrainedConfig:
    """A tiny random config of ``model_type`` (hidden 64, ``num_layers`` layers; ``overrides``
    set other config fields, e.g. ``tie_word_embeddings=True``)."""
    kwargs = {**TINY_CONFIGS[model_type], **overrides}
    key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
    kwargs[key] = num_layers
    if "layer_types" in kwargs:
        kwargs["layer_types"] = (kwargs["layer_types"] * num_layers)[:num_layers]
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, num_layers: int = 4, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny randomly initialised causal LM of ``model_type``, fp32, eval mode, on CPU."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, num_layers, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def move_off_init(model, scale: float = 0.5, seed: int = 7):
    """``model`` (a LoopedModel) with every new parameter moved by ``scale`` times seeded
    standard-normal noise, in place: second passes and later loops then contribute, as after
    training (zero gates would hide a wrong graph); returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.new_parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return model


def left_padded_batch(rows: int, length: int = 7, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: ``rows`` random prompts of ``length`` tokens, row ``r``
    left-padded by ``r % 3`` positions (pad id 0)."""
    prompt = torch.randint(3, 250, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(prompt)
    for r in range(rows):
        mask[r, : r % 3] = 0
    return prompt.masked_fill(mask == 0, 0), mask


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: token-id lists left-padded to one width (pad id 0)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    return ids, mask


def batch_gaps(
    generate, prompts: list[list[int]], budgets: list[int], groups: list[list[int]], new_tokens: int, **kwargs
) -> tuple[float, list[int]]:
    """How far batching moves greedy answers: each of ``prompts`` generated alone by ``generate``
    (a runtime's ``generate``, or :func:`looptool.runtime.generation.generate` bound to a model;
    ``kwargs`` to every call) at its budget, then each of ``groups`` (lists of prompt indices) as
    one left-padded batch, each row at its prompt's budget. Returns the largest logit difference
    between a row and its prompt alone, over the steps up to the row's first different token
    (after it their inputs differ), and the prompts whose tokens differ in some batch."""
    alone = [
        generate(torch.tensor([p]), budget=b, max_new_tokens=new_tokens, output_logits=True, **kwargs)
        for p, b in zip(prompts, budgets)
    ]
    worst, differ = 0.0, set()
    for group in groups:
        ids, mask = left_pad([prompts[i] for i in group])
        got = generate(
            ids,
            attention_mask=mask,
            budget=[budgets[i] for i in group],
            max_new_tokens=new_tokens,
            output_logits=True,
            **kwargs,
        )
        for r, i in enumerate(group):
            mine, ref = got.sequences[r, ids.shape[1] :], alone[i].sequences[0, -new_tokens:]
            same = int((mine == ref).long().cumprod(0).sum())  # steps before the first different token
            if same < new_tokens:
                differ.add(i)
            steps = zip(got.logits[: same + 1], alone[i].logits[: same + 1])
            worst = max(worst, max((a[r] - b[0]).abs().max().item() for a, b in steps))
    return worst, sorted(differ)


def save_to_hub_cache(
    model, repo_id: str, cache_dir: str | Path, *, commit: str, refs: tuple[str, ...] = ("main",), tokenizer=None
) -> Path:
    """Save ``model`` (and ``tokenizer``) into a Hugging Face Hub cache as if ``repo_id`` at
    ``commit`` had been downloaded, with each of ``refs`` (branches or tags) pointing at it, so
    Hub ids can be used offline (``HF_HUB_OFFLINE=1``); returns the snapshot directory.

    The layout is ``huggingface_hub``'s: ``models--org--name/snapshots/<commit>/`` holds the
    files and ``refs/<ref>`` the commit (plain files instead of symlinks into ``blobs/``,
    which ``huggingface_hub`` reads the same way)."""
    storage = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    model.save_pretrained(snapshot)
    if tokenizer is not None:
        tokenizer.save_pretrained(snapshot)
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def write_tiny_gguf(path: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A tiny Llama GGUF file (fp32 tensors, a byte-pair vocabulary of eight tokens) at
    ``path``, written with gguf's own ``GGUFWriter`` and loadable by transformers like any
    GGUF checkpoint (needs the ``gguf`` package)."""
    import gguf
    import numpy as np

    d, ff, heads, kv_heads = 32, 64, 4, 2
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>", "</s>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(num_layers)
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b", "b c", "ab c"])
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    rng = np.random.default_rng(seed)
    kv = kv_heads * d // heads
    shapes = {"token_embd.weight": (len(tokens), d), "output_norm.weight": (d,), "output.weight": (len(tokens), d)}
    for i in range(num_layers):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (d,),
                f"blk.{i}.attn_q.weight": (d, d),
                f"blk.{i}.attn_k.weight": (kv, d),
                f"blk.{i}.attn_v.weight": (kv, d),
                f"blk.{i}.attn_output.weight": (d, d),
                f"blk.{i}.ffn_norm.weight": (d,),
                f"blk.{i}.ffn_gate.weight": (ff, d),
                f"blk.{i}.ffn_up.weight": (ff, d),
                f"blk.{i}.ffn_down.weight": (d, ff),
            }
        )
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_tokenizer(eos: int = 10):
    """A real fast tokenizer over the 256 byte-level symbols (ids 0-255, no merges), so tiny
    models with ``vocab_size=256`` can read and write text. EOS is the byte ``eos`` (default:
    the newline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in enumerate(sorted(alphabet, key=lambda ch: _byte_of(ch)))}
    vocab = {ch: b for b, ch in byte_to_char.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=byte_to_char[eos], pad_token=byte_to_char[0])


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes-to-unicode map for one symbol."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


def kill_after_line(argv: list[str], prefix: str, timeout: float = 300.0) -> tuple[int, list[str]]:
    """Run ``argv``, read its stderr until a line starts with ``prefix``, then ``kill -9`` it
    (resume tests: a kill between two checkpoints). Returns the exit status (``-SIGKILL``
    unless the process ended first) and the stderr lines read."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(prefix) or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGKILL)
        return proc.wait(), lines
    finally:
        proc.kill()
        proc.stderr.close()


def step_log(path: Path) -> list[dict]:
    """A JSONL step log without its timings (what a resumed run reproduces exactly)."""
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in path.read_text().splitlines()]


def assert_same_weights(a: Path, b: Path, initial: Path) -> None:
    """The saved models ``a`` and ``b`` hold bit-identical weights, which training moved away
    from those of ``initial`` (so the equality is not trivial)."""
    from safetensors.torch import load_file

    wa, wb, w0 = (load_file(d / "model.safetensors") for d in (a, b, initial))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], w0[k]) for k in wa)


def plain_steps(inner):
    """A step engine that runs ``inner``'s plain cached steps and nothing else (no adaptive
    depth, no verify step), as an engine that only runs fixed budgets does: for tests of the
    refusals a server gives when its engine cannot run a request."""
    from looptool.core.errors import LooptoolError
    from looptool.engine.interface import Capabilities, StepEngine

    class PlainSteps(StepEngine):
        def __init__(self) -> None:
            self.budgets, self.vocab_size, self.mask_dtype = inner.budgets, inner.vocab_size, inner.mask_dtype
            self.capabilities = Capabilities(
                inner.capabilities.kv,
                inner.capabilities.precision,
                LooptoolError("PlainSteps runs fixed budgets only.", parameter="runtime"),
                LooptoolError("PlainSteps has no verify step.", parameter="runtime"),
            )

        def allocate(self, slots: int, length: int):
            return inner.allocate(slots, length)

        def run(self, cache, batch):
            self.capabilities.check(batch)
            return inner.run(cache, batch)

    return PlainSteps()


def every_onnx_node(graph):
    """The nodes of an ``onnx.GraphProto`` and of its subgraphs (``Loop`` bodies, ``If``
    branches), depth first: a looped graph's layers sit in its ``Loop`` bodies."""
    import onnx

    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from every_onnx_node(attr.g)


# ---------------------------------------------------------------------- a reference decode loop
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_loop(
    step: Step,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    capacity: int,
    max_new_tokens: int,
    mask_dtype: torch.dtype,
    sampling: SamplingParams = GREEDY,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    on_step: Callable[[torch.Tensor], bool | None] | None = None,
    output_logits: bool = False,
    kv_bytes: int = 0,
) -> GenerationOutput:
    """A static-batch prefill-then-decode loop over a raw step function: the independent
    reference the tests check the engine core against (a fixed cache of ``capacity`` slots,
    every row fed each step, EOS rows fed padding), and a harness for timing one path.

    ``step(ids, attention_mask, position_ids, cache_position)`` runs one cached step and
    returns the next-token logits ``[batch, vocab]``; the loop owns the
    ``[batch, capacity]`` mask (updated in place, so a runtime may bind it once), picks
    tokens under ``sampling``, stops rows at EOS and times both phases.
    """
    device = input_ids.device
    batch, prompt = input_ids.shape
    if prompt + max_new_tokens > capacity:
        raise LooptoolError(
            f"the prompt ({counted(prompt, 'token')}) plus {counted(max_new_tokens, 'new token')} exceed the cache capacity "
            f"of {capacity}; raise the capacity or generate fewer tokens."
        )
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []), device=device)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    pick = TokenPicker(sampling, device)
    mask = torch.zeros(batch, capacity, dtype=mask_dtype, device=device)
    mask[:, :prompt] = 1 if attention_mask is None else attention_mask.to(device=device, dtype=mask_dtype)
    ids = input_ids
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    position = position_ids(mask[:, :prompt])
    t0 = time.perf_counter()
    logits = step(ids, mask, position, torch.arange(prompt, device=device))
    prefill = time.perf_counter() - t0
    steps = 0
    kept: list[torch.Tensor] = []
    t1 = time.perf_counter()
    for i in range(max_new_tokens):
        if i > 0:
            slot = prompt + i - 1
            mask[:, slot] = 1
            position = position[:, -1:] + 1
            logits = step(ids[:, -1:], mask, position, torch.tensor([slot], device=device))
        if output_logits:
            kept.append(logits.clone())
        token = pick(logits, ids)
        token = torch.where(done, torch.full_like(token, pad), token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        steps += 1
        if on_step is not None and on_step(token):
            break  # the caller's stop condition (e.g. a stop string) holds for every row
        if len(eos):
            done |= torch.isin(token, eos)
            if bool(done.all()):
                break
    decode = time.perf_counter() - t1
    return GenerationOutput(ids, steps, prefill, decode, kv_bytes, kv_bytes / (batch * capacity), tuple(kept))


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as transformers' generate computes them."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


class AutoStep:
    """One generation's adaptive-depth step: ``step(ids, mask, position_ids, cache_position)``
    runs the adaptive path over this call's cache and returns the next-token logits ``[batch,
    vocab]``, keeping each row's realised depth (:meth:`depths`). ``skip=False`` runs the
    masked path (every step to the batch's deepest ``max_budget``; same results, for timing)."""

    def __init__(
        self, model: LoopedNetwork, batch: int, capacity: int, settings: AutoDepth, kv: str | None, *, skip: bool = True
    ):
        self.path = adaptive_path(model, check_auto_policy(model, kv), settings.exit_rule, skip=skip)
        param = next(model.parameters())
        self.device = param.device
        self.caches = allocate_cache(self.path, batch, capacity, dtype=param.dtype, device=param.device)
        self.kv_bytes = sum(c.numel() * c.element_size() for c in self.caches)
        self.inputs = (
            torch.full((batch,), settings.min_budget, dtype=torch.int64, device=param.device),
            torch.full((batch,), settings.max_budget, dtype=torch.int64, device=param.device),
            torch.full((batch,), settings.exit_threshold, dtype=torch.float32, device=param.device),
        )
        self._depths: list[torch.Tensor] = []

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, cache_position: torch.Tensor
    ) -> torch.Tensor:
        logits, depth = self.path.module(ids, mask, position, cache_position, *self.inputs, *self.caches)
        self._depths.append(depth)
        return logits[:, -1]

    def depths(self, new_tokens: int) -> torch.Tensor:
        """``[batch, new_tokens]``: the depth that produced each new token (step ``t``'s logits
        pick token ``t``)."""
        if new_tokens == 0 or not self._depths:
            return torch.zeros(self.inputs[0].shape[0], 0, dtype=torch.int64, device=self.device)
        return torch.stack(self._depths[:new_tokens], dim=1)
