"""lm-evaluation-harness adapter: any budget of a saved looped model as an lm-eval model.

``LooptoolLM`` is registered with lm-eval as ``looptool``::

    python -m looptool.eval.harness --model looptool \\
        --model_args pretrained=./looped,budget=6,kv=last-loop --tasks hellaswag

lm-eval 0.4.13 finds models only in its own registry (no plug-in entry points), so a bare
``lm_eval --model looptool`` cannot see this class; ``python -m looptool.eval.harness ARGS`` imports
the registration and then runs lm-eval's own command line (``lm_eval.__main__.cli_evaluate``)
on ``ARGS``: it is exactly ``lm_eval ARGS`` with one more model. From Python, import this
module and pass ``model="looptool"`` (or a ``LooptoolLM``) to ``lm_eval.simple_evaluate``.

Scoring mirrors lm-eval's ``hf`` model request for request (same tokenisation rules, same
length-sorted batches, right padding, the one-token-continuation logits cache, the same
rolling windows), with the budget's full-sequence path in place of the HF forward; so at a
fresh conversion every budget's numbers equal ``hf`` on the source model. ``generate_until``
runs looptool's own KV-cached generation (:func:`looptool.runtime.generation.generate`) on
left-padded batches and stops when every row has produced a stop string or EOS.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from looptool.core.errors import LooptoolError, MissingExtraError, require_extra

try:
    require_extra("eval", "lm-evaluation-harness support", "lm_eval")
except MissingExtraError as _exc:
    if __name__ == "__main__":  # python -m looptool.eval.harness without lm-eval: one sentence, no traceback
        raise SystemExit(f"error: {_exc}") from None
    raise

import lm_eval  # noqa: E402
import lm_eval.models  # noqa: E402,F401  (lm-eval's own models: get_model skips them once any model is registered)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import (  # noqa: E402
    Collator,
    configure_pad_token,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.models.utils_hf import pad_and_concat  # noqa: E402

from looptool.engine.sampling import SamplingParams  # noqa: E402
from looptool.runtime.convert import load  # noqa: E402
from looptool.runtime.decode_graphs import check_policy  # noqa: E402
from looptool.runtime.generation import generate  # noqa: E402
from looptool.runtime.model import LoopedModel  # noqa: E402

MODEL_NAME = "looptool"
_SAMPLING_KWARGS = frozenset({"do_sample", "temperature", "top_k", "top_p"})


class LooptoolLM(TemplateLM):
    """One budget of a looped model as an lm-eval ``LM`` (``--model looptool``).

    ``model_args``: ``pretrained`` (a directory saved by looptool, or a :class:`LoopedModel`),
    ``budget`` (default: the deepest), ``kv`` (``per-loop`` or ``last-loop``: the KV cache of
    ``generate_until``), ``batch_size``, ``device``, ``dtype`` (``auto`` or the saved dtype; the
    captured graphs cannot change dtype), ``max_length`` (default: from the config, as ``hf``),
    ``max_gen_toks``, ``add_bos_token``, ``prefix_token_id`` and ``logits_cache`` as for ``hf``.
    ``budget`` can be changed between evaluations (``lm.budget = k``) without reloading.
    """

    def __init__(
        self,
        pretrained: str | LoopedModel,
        budget: int | None = None,
        kv: str = "per-loop",
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,  # lm-eval passes it for batch_size=auto, which is not supported
        device: str | None = "auto",
        dtype: str | None = "auto",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        logits_cache: bool = True,
        **kwargs,
    ) -> None:
        super().__init__()
        if kwargs:
            raise LooptoolError(
                f"the looptool model does not take {', '.join(sorted(kwargs))}; its model_args are pretrained, budget, "
                "kv, batch_size, device, dtype, max_length, max_gen_toks, add_bos_token, prefix_token_id, logits_cache."
            )
        if isinstance(pretrained, LoopedModel):
            self.model = pretrained
        else:
            self.model = load(pretrained, device=_device(device))
        self._check_dtype(dtype)
        if self.model.tokenizer is None:
            raise LooptoolError(
                "this looped model was saved without a tokenizer; save one next to it "
                "(tokenizer.save_pretrained(DIR)) to evaluate it with lm-eval."
            )
        self.tokenizer = configure_pad_token(self.model.tokenizer, model_config=self.model.config)
        self.pretrained = str(pretrained) if not isinstance(pretrained, LoopedModel) else None
        self.budget = budget
        self.kv = check_policy(self.model, kv)
        self.batch_size = _batch_size(batch_size)
        self._max_length = int(max_length) if max_length else None
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.logits_cache = logits_cache
        self._device = next(self.model.parameters()).device

    # ------------------------------------------------------------------ settings
    def _check_dtype(self, dtype: str | None) -> None:
        saved = self.model.layer_graph.source.dtype
        if dtype in (None, "auto") or str(dtype).removeprefix("torch.") == saved.removeprefix("torch."):
            return
        raise LooptoolError(
            f"dtype={dtype} differs from the saved model's {saved}; its graphs are specialised to that "
            "dtype: drop dtype, or convert the source model again in the dtype wanted.",
            parameter="dtype",
        )

    @property
    def budget(self) -> int:
        """The budget every request runs at."""
        return self._budget

    @budget.setter
    def budget(self, value: int | str | None) -> None:
        self._budget = self.model.check_budget(None if value in (None, "") else int(value))

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is conditioned on: ``prefix_token_id``, else BOS, else EOS (as ``hf``)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Longest input in tokens: ``max_length`` if given, else from the config (as ``hf``)."""
        return self._max_length or resolve_max_length(self.model.config, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict:
        """What lm-eval records in ``results["config"]``: the budget, KV policy and plan."""
        return {"looptool_budget": self.budget, "looptool_kv": self.kv, "looptool_plan": self.model.plan.to_dict()}

    # ------------------------------------------------------------------ tokens
    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """Token ids of ``string`` (special tokens as ``hf`` adds them), optionally left-truncated."""
        special = self._special_tokens(add_special_tokens)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def _special_tokens(self, add_special_tokens: bool | None) -> dict:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        return {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}

    def _encode_prompts(self, strings: list[str], left_truncate_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask of a batch of prompts, each keeping its last ``left_truncate_len`` tokens."""
        special = (
            {"add_special_tokens": False}
            if has_bos_prefix(strings[0], self.tokenizer.bos_token)
            else self._special_tokens(None)
        )
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            enc = self.tokenizer(strings, padding="longest", return_tensors="pt", **special)
        finally:
            self.tokenizer.padding_side = side
        return enc["input_ids"][:, -left_truncate_len:], enc["attention_mask"][:, -left_truncate_len:]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the tokenizer's chat template."""
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def _log_probs(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Log-softmax of the budget path over a right-padded batch. The captured paths take
        positions 0..seq-1, so right padding is exact: under the causal mask a real token never
        sees the padding after it (``hf`` runs its model the same way, without a mask)."""
        batch = pad_and_concat(max(len(t) for t in inputs), list(inputs), padding_side="right").to(self.device)
        return F.log_softmax(self.model(batch, budget=self.budget).logits, dim=-1)

    def _loglikelihood_tokens(
        self, requests: Sequence[tuple], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy?)`` per ``(key, context_ids, continuation_ids)``,
        in batches of requests sorted longest first (requests that differ only in a one-token
        continuation share one row, as in ``hf``)."""
        collator = Collator(
            list(requests),
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts" if self.logits_cache else None,
            group_fn=lambda r: r[1] + r[2][:-1],
        )
        results: list[tuple[float, bool]] = []
        for chunk in collator.get_batched(n=self.batch_size):
            inputs = []
            for _, context, continuation in chunk:
                if len(continuation) > self.max_length:
                    raise LooptoolError(
                        f"a continuation of {len(continuation)} tokens is longer than max_length "
                        f"{self.max_length}; raise max_length.",
                        parameter="max_length",
                    )
                # the last max_length + 1 tokens, minus the last: its logits would predict nothing
                inputs.append(torch.tensor((context + continuation)[-(self.max_length + 1) :][:-1], dtype=torch.long))
            log_probs = self._log_probs(inputs)
            for (key, context, continuation), row, inp in zip(chunk, log_probs, inputs, strict=True):
                scored = row[len(inp) - len(continuation) : len(inp)].unsqueeze(0)  # [1, cont, vocab]
                greedy = scored.argmax(-1)
                for key_, cont, scored_ in collator.get_cache(
                    req_str=key, cxt_toks=context, cont_toks=continuation, logits=scored
                ):
                    cont_ids = torch.tensor(cont, dtype=torch.long, device=self.device).unsqueeze(0)
                    is_greedy = bool((greedy[:, -cont_ids.shape[1] :] == cont_ids).all())
                    answer = (float(torch.gather(scored_, 2, cont_ids.unsqueeze(-1)).sum()), is_greedy)
                    results.append(answer)
                    if key_ is not None:
                        self.cache_hook.add_partial("loglikelihood", key_, answer)
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document: disjoint rolling windows of ``max_length``
        tokens (each with the most context), summed; windows are batched across documents."""
        windows: list[tuple[int, tuple]] = []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((index, (None, context, continuation)))
        totals = [0.0] * len(requests)
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start : start + self.batch_size]
            scores = self._loglikelihood_tokens([w for _, w in batch])
            for (index, _), (logprob, _) in zip(batch, scores, strict=True):
                totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continue each context with looptool's KV-cached generation at this budget (``kv``
        policy), batched by generation settings, until a stop string of ``until``, EOS or
        ``max_gen_toks`` new tokens; the text is cut before the first stop string."""
        collator = Collator(
            [req.args for req in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        results: list[str] = []
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise LooptoolError(
                    f"max_gen_toks {max_gen_toks} leaves no room for the prompt within max_length "
                    f"{self.max_length}; lower max_gen_toks or raise max_length.",
                    parameter="max_length",
                )
            ids, mask = self._encode_prompts(list(contexts), self.max_length - max_gen_toks)
            new_tokens = self._generate(ids, mask, until, max_gen_toks, kwargs)
            for context, gen_kwargs, tokens in zip(contexts, all_kwargs, new_tokens, strict=True):
                text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return collator.get_original(results)

    def _generate(
        self, ids: torch.Tensor, mask: torch.Tensor, until: list[str], max_new_tokens: int, kwargs: dict
    ) -> list[list[int]]:
        """New tokens per row; decoding ends early once every row holds a stop string or EOS."""
        unknown = set(kwargs) - _SAMPLING_KWARGS
        if unknown:
            raise LooptoolError(
                f"the looptool model does not support the generation setting(s) {', '.join(sorted(unknown))}; "
                "it takes until, max_gen_toks, do_sample, temperature, top_k and top_p."
            )
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        eos = _eos_ids(self.model.config, self.tokenizer)
        rows: list[list[int]] = [[] for _ in range(ids.shape[0])]
        stops = [s for s in until if s]

        def on_step(tokens: torch.Tensor) -> bool:
            for row, token in zip(rows, tokens.tolist(), strict=True):
                row.append(token)
            return all(
                any(t in eos for t in row)
                or any(s in self.tokenizer.decode(row, skip_special_tokens=True) for s in stops)
                for row in rows
            )

        generate(
            self.model,
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            budget=self.budget,
            max_new_tokens=max_new_tokens,
            kv=self.kv,
            sampling=SamplingParams(temperature, kwargs.get("top_k"), kwargs.get("top_p")),
            eos_token_id=sorted(eos),
            pad_token_id=self.tokenizer.pad_token_id,
            on_step=on_step,
        )
        return rows


def _batch_size(value: int | str | None) -> int:
    """A positive integer batch size (lm-eval's ``auto`` detection is not supported)."""
    try:
        size = int(value if value is not None else 1)
    except (TypeError, ValueError):
        raise LooptoolError(
            f"batch_size={value!r} is not supported by the looptool model; give a positive integer.",
            parameter="batch_size",
        ) from None
    if size < 1:
        raise LooptoolError(f"batch_size must be at least 1, got {size}.", parameter="batch_size")
    return size


def _device(name: str | None) -> str:
    """The device to load on: ``auto``/None → cuda when available; a CUDA device on a machine
    without CUDA falls back to the CPU with a warning, as lm-eval's ``hf`` model does (lm-eval's
    command line passes ``cuda:0`` unless told otherwise)."""
    import logging

    if name not in (None, "auto") and str(name).startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning("device %s was asked for but CUDA is not available; using the CPU", name)
        return "cpu"
    return str(name or "auto")


def _eos_ids(config, tokenizer) -> set[int]:
    """The tokens that end a row: the model config's EOS (where HF ``generate`` stops) and the tokenizer's."""
    ids = config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


if __name__ != "__main__":  # under python -m, main() imports this module, which registers the class once
    register_model(MODEL_NAME)(LooptoolLM)


def main(argv: list[str] | None = None) -> None:
    """``python -m looptool.eval.harness ARGS``: lm-eval's own command line (``lm_eval ARGS``) with
    the ``looptool`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    import looptool.eval.harness

    looptool.eval.harness.main()
