"""The `kimi_helix` model for lm-evaluation-harness, built on the paged engine `LLM`.

    lm-eval run --model kimi_helix --model_args pretrained=DIR,dtype=bfloat16 --tasks ...   (via kimi_helix.evals)

- `loglikelihood`: every (context, continuation) is one engine request with `prompt_logprobs=0` and `max_tokens=1`;
  the continuation's log-probability is the sum of its prompt-token entries, greedy when each has rank 1.
- `loglikelihood_rolling`: lm-eval's own rolling windows of `max_length` tokens (`get_rolling_token_windows` and
  `make_disjoint_window`, one token of context), each scored as above and summed.
- `generate_until`: one request per context with the task's stop strings and `max_gen_toks`.

Data parallel: under `torchrun` each process holds a whole model; `rank`/`world_size` come from the launcher and
lm-eval's evaluator splits the requests and gathers the metrics through `all_gather`/`gather_object`/`barrier`.
With `tp`/`cp` every process of the launch holds a shard of one model and reports rank 0 of 1 (lm-eval's TP rule).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..engine import LLM, SamplingParams

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_GEN_TOKS = 256
AUTO_CHUNK = 256

log = logging.getLogger(__name__)


@register_model("kimi_helix")
class KimiHelixLM(TemplateLM):
    """lm-eval `LM` over `kimi_helix.engine.LLM`.

    Args (lm-eval `model_args`):
        pretrained: checkpoint folder (config.json, safetensors, tokenizer files).
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        device: "cuda", "cuda:N" or "cpu"; under torchrun data parallel each process takes cuda:LOCAL_RANK.
        batch_size: requests handed to the engine at a time (it batches them continuously up to its own
            `max_num_seqs`); "auto" hands it 256 at a time, which keeps the engine full and the progress bar moving.
        max_length: tokens a prediction may condition on (default: the engine's max_model_len rule, <= 8192).
        max_gen_toks: default generation length when a task gives none.
        speculative_method, num_speculative_tokens, speculative_model: the engine's `speculative_config`.
        tp, cp: tensor-parallel and Helix context-parallel sizes (`tensor_parallel_size`/`context_parallel_size`).
    """

    def __init__(
        self,
        pretrained: str,
        dtype: str = "auto",
        device: str | None = None,
        batch_size: int | str = "auto",
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        speculative_method: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_model: str | None = None,
        tp: int = 1,
        cp: int = 1,
        max_batch_size: int | None = None,  # lm-eval passes it to every model; the engine sizes its own batches
        **engine_kwargs,
    ):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        for name, value in (("tp", tp), ("cp", cp), ("max_gen_toks", max_gen_toks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        # lm-eval spells it "auto" or "auto:N"; the engine sizes its own steps, so both mean the default chunk.
        self.batch_size = AUTO_CHUNK if str(batch_size).startswith("auto") else _positive_int("batch_size", batch_size)
        self.max_gen_toks = max_gen_toks
        self._rank, self._world_size = _data_parallel_rank(tp * cp)
        self._sharded = tp * cp > 1
        device = _device_for_rank(device, self._world_size)
        self.tokenizer = AutoTokenizer.from_pretrained(pretrained, trust_remote_code=False)
        self.pretrained = str(pretrained)
        engine_kwargs.update(_speculative_kwargs(speculative_method, num_speculative_tokens, speculative_model))
        engine_kwargs.update(_parallel_kwargs(tp, cp))
        if max_length is not None:
            # A rolling window scores max_length tokens after one of context; the engine then draws one more.
            engine_kwargs.setdefault("max_model_len", max_length + 2)
        self.llm = LLM(pretrained, dtype=DTYPES[dtype], device=device, tokenizer=self.tokenizer, **engine_kwargs)
        self._max_length = max_length or self.llm.max_model_len - 2
        self._device = self.llm.device

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> KimiHelixLM:
        """lm-eval's constructor hook: `--model_args` win over the CLI's `--device`/`--batch_size`, so
        `model_args=device=cpu` and `--device cpu` both work."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KimiHelixLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ---------------------------------------------------------------- lm-eval's model properties
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Documents longer than the tokenizer's model_max_length are expected: rolling windows split them.
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens), verbose=False)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (None when it has none: lm-eval then formats plain prompts)."""
        if not chat_template:
            return None
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `chat_history` with the tokenizer's chat template (lm-eval's `--apply_chat_template`)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"the tokenizer of {self.pretrained} has no chat template; run without --apply_chat_template"
            )
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ---------------------------------------------------------------- data parallel hooks
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate `tensor` (a 0-d or [N] tensor) from every rank, in rank order."""
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        flat = tensor.reshape(-1).to(_collective_device())
        out = [torch.empty_like(flat) for _ in range(self._world_size)]
        dist.all_gather(out, flat)
        return torch.cat(out)

    def gather_object(self, obj, dst: int = 0):
        """`obj` of every rank as a list on `dst`, None elsewhere."""
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ---------------------------------------------------------------- requests
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Score `requests` [((context, continuation), context_ids, continuation_ids), ...] in engine batches."""
        out = []
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm or self._rank != 0)
        for chunk in self._chunks(requests):
            scores = self._score_token_pairs([(ctx, cont) for _, ctx, cont in chunk])
            for (pair, _, _), score in zip(chunk, scores):
                if pair is not None:
                    self.cache_hook.add_partial("loglikelihood", pair, score)
            out.extend(scores)
            bar.update(len(chunk))
        bar.close()
        return out

    def _chunks(self, items: list) -> list[list]:
        return [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]

    def _score_token_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), every continuation token the argmax) per token-id pair.

        Each prediction conditions on at most `max_length` tokens: the context is cut on the left."""
        prompts = []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("a loglikelihood request has an empty continuation")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
            prompts.append((ctx + cont)[-(self.max_length + 1) :])
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        results = []
        for (_, cont), output in zip(pairs, self.llm.generate(prompts, params, use_tqdm=False)):
            entries = output.prompt_logprobs[-len(cont) :]
            picked = [entry[token] for entry, token in zip(entries, cont)]
            results.append((sum(p.logprob for p in picked), all(p.rank == 1 for p in picked)))
        return self._from_first_shard(results)

    def _from_first_shard(self, results: list) -> list:
        """With tp/cp the engine returns outputs on global rank 0 only; every shard's process needs them, since
        each runs lm-eval's whole evaluation."""
        if not self._sharded:
            return results
        import torch.distributed as dist

        box = [results]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-probability of each whole string, over lm-eval's disjoint rolling windows of `max_length`."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            rolling = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
            for pair in map(make_disjoint_window, rolling):
                windows.append((None, *pair))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string, EOS or `max_gen_toks` tokens."""
        out = []
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or self._rank != 0)
        for chunk in self._chunks(requests):
            prompts, params, stops = [], [], []
            for context, gen_kwargs in (req.args for req in chunk):
                sampling, until = self._sampling_params(gen_kwargs)
                keep = self.max_length - sampling.max_tokens
                if keep < 1:
                    raise ValueError(
                        f"max_gen_toks={sampling.max_tokens} leaves no room in max_length={self.max_length}"
                    )
                prompts.append(self.tok_encode(context)[-keep:])
                params.append(sampling)
                stops.append(until)
            texts = self._from_first_shard([o.text for o in self.llm.generate(prompts, params, use_tqdm=False)])
            for req, text, until in zip(chunk, texts, stops):
                for stop in until:  # the engine stops at the first stop string; cut it off whatever it matched
                    text = text.split(stop)[0]
                self.cache_hook.add_partial("generate_until", req.args, text)
                out.append(text)
            bar.update(len(chunk))
        bar.close()
        return out

    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """The engine's params for one lm-eval `gen_kwargs`; greedy unless `do_sample` with a temperature > 0."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eot = self.tok_decode([self.eot_token_id]) if self.eot_token_id is not None else ""
        if eot and eot not in until:
            until.append(eot)
        max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=float(kwargs.pop("top_p", 1.0)),
            top_k=int(kwargs.pop("top_k", 0)),
            seed=kwargs.pop("seed", None),
            stop=until,
        )
        if kwargs:
            log.warning("generate_until ignores gen_kwargs the engine has no setting for: %s", sorted(kwargs))
        return params, until


def _positive_int(name: str, value) -> int:
    if not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be 'auto' or an int >= 1, got {value!r}")
    return int(value)


def _data_parallel_rank(model_parallel: int) -> tuple[int, int]:
    """(rank, world size) of lm-eval's data-parallel split, from torchrun's variables; starts the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if model_parallel > 1:
        if world != model_parallel:
            raise ValueError(
                f"tp * cp = {model_parallel} must equal the launch's WORLD_SIZE={world}: data parallel over "
                "sharded models is not supported; launch tp * cp processes"
            )
        return 0, 1  # every shard of the one model sees every request; lm-eval prints on LOCAL_RANK 0
    return dist.get_rank(), world


def _device_for_rank(device: str | None, world: int) -> str | None:
    """Under data parallel on CUDA each process takes the GPU of its LOCAL_RANK (lm-eval's CLI passes "cuda:0" to
    every process); without CUDA a cuda device falls back to the CPU with a warning, as lm-eval's HF model does."""
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s is not available; running on the CPU", device)
        return "cpu"
    if world > 1 and torch.cuda.is_available() and device in (None, "cuda", "cuda:0"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _speculative_kwargs(method: str | None, k: int | None, draft_model: str | None) -> dict:
    if method is None and k is None and draft_model is None:
        return {}
    if method is None:
        raise ValueError("num_speculative_tokens / speculative_model need speculative_method (e.g. ngram, dspark)")
    config = {"method": method}
    if k is not None:
        config["num_speculative_tokens"] = k
    if draft_model is not None:
        config["model"] = str(Path(draft_model))
    return {"speculative_config": config}


def _parallel_kwargs(tp: int, cp: int) -> dict:
    if tp == 1 and cp == 1:
        return {}
    return {"tensor_parallel_size": tp, "context_parallel_size": cp}
