"""Cold-start SFT conversations (spec 11.3): JSON / JSON-lines / parquet files -> (token ids, loss mask) pairs.

Input formats, detected per file (`format="auto"`) from the first row that is a dict:
  * ``sharegpt`` (LLaMA-Factory, the reference's ``dataset_info.json``: ``messages: conversations``,
    ``system: system``): ``conversations`` = [{"from": "human" | "gpt" | "system" | "observation" | ..., "value"}]
    plus an optional ``system`` field;
  * ``openai``: ``messages`` = [{"role": "system" | "user" | "assistant" | "tool", "content"}];
  * ``alpaca``: ``instruction`` / ``input`` / ``output`` (+ ``system``), as Tool-Star-SFT-54K stores it; the user
    turn is ``instruction + "\\n" + input`` as LLaMA-Factory builds it.

Mapping onto the rollout format (spec 2.3, 3.3). In RL the whole tool interaction is ONE assistant turn: the
policy writes ``... </python>``, the rollout splices ``" <result>\\n" + output + "\\n</result>"`` (loss 0) and
the policy continues in the same turn. SFT must teach exactly that text, so a tool result that a file stores as
its own turn (role ``tool`` / ``observation``, or a user turn whose whole value is ``<result>...</result>``
right after an assistant turn) is spliced into the preceding assistant turn with the rollout's bytes, and the
assistant text after it continues the same turn. (Rendered as separate ChatML turns, as LLaMA-Factory would, the
model would learn to close its turn after every tool call, which the rollout never does.)

Loss mask: 1 on the tokens of assistant turns (the turn's text plus the end-of-turn token that closes it, e.g.
``<|im_end|>``, so the model learns to stop; not the newline the template puts after it), 0 on system, user and
template tokens. With ``mask_tool_results=True`` (the default, as the RL loss mask) ``<result>...</result>`` spans
inside assistant turns (and the whitespace before them) get 0 too. The reference's data keeps tool results inline
in the ``gpt`` value and LLaMA-Factory trains on them; ``mask_tool_results=False`` reproduces that.

The mask is computed on characters and mapped to tokens through the fast tokenizer's offsets: the assistant turn
``i`` spans from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
``render(messages[:i+1])`` (both prefixes of the full render for ChatML, Llama 3 and most templates), cut after
its end-of-turn marker. A token gets loss 1 only when all its characters do. Templates that rewrite earlier turns
(so that a prefix is not a prefix) fall back to locating the turn's content in the full text; a final assistant
turn that the template rewrites (Qwen3 drops all but the first and last think blocks) is rendered verbatim after
the generation prompt, as the rollout produces it (`_raw_final_turn`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from arpo_jax.data.rl_dataset import MalformedRow

log = logging.getLogger(__name__)

FORMATS = ("auto", "sharegpt", "openai", "alpaca")
BUILTIN_TOY = "builtin:toy"
TOY_SFT_EXAMPLES = 256  # conversations generated for `builtin:toy`
# sharegpt "from" / openai "role" values -> the roles used here ("tool" = a tool result).
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool"}
# End-of-turn markers of common templates; the assistant span is cut right after the last one it contains.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
RESULT_RE = re.compile(r"\s*<result>.*?</result>", re.DOTALL)
_MAX_WARNINGS = 5  # malformed rows logged one by one; the rest only in the summary


@dataclasses.dataclass
class SFTDataset(Sequence):
    """(ids [L] int32, loss_mask [L] int32) per example, token-aligned (mask j = token j is trained), no padding.

    `skipped`: (file, row, reason) of malformed rows; `truncated`: examples cut to cutoff_len; `dropped`: examples
    left with no trainable token after the cut (not in `examples`).
    """

    examples: list[tuple[np.ndarray, np.ndarray]]
    files: tuple[str, ...]
    skipped: list[tuple[str, int, str]]
    truncated: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[int(i)]

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(ids) for ids, _ in self.examples], np.int64)

    @property
    def loss_tokens(self) -> np.ndarray:
        """[N] trained tokens per example (token 0 is never predicted, so it does not count)."""
        return np.array([int(m[1:].sum()) for _, m in self.examples], np.int64)


# ----------------------------------------------------------------------------------------------- toy data


def toy_sft_conversations(n: int = TOY_SFT_EXAMPLES, seed: int = 0) -> list[dict]:
    """`n` solved toy tasks as OpenAI-style rows: system prompt, question, one assistant turn with the tool calls,
    their results spliced as the rollout does (python output computed directly, search: the gold document) and
    the boxed answer. Split "sft", so the questions differ from the RL split's."""
    from arpo_jax.data import toy
    from arpo_jax.data.prompts import SYSTEM_PROMPT, chat_messages

    return [{"messages": [*chat_messages(task.question, SYSTEM_PROMPT),
                          {"role": "assistant", "content": toy.solution_text(task)}]}
            for task in toy.toy_tasks("sft", n, seed)]


# ----------------------------------------------------------------------------------------------- reading


def read_records(path: str, *, seed: int = 0) -> Iterator[tuple[int, Any]]:
    """(row, record) of a JSON array / JSON-lines / parquet file; a JSON line that does not parse is yielded as a
    MalformedRow instead of a record, so one bad line costs one row."""
    if path == BUILTIN_TOY:
        yield from enumerate(toy_sft_conversations(TOY_SFT_EXAMPLES, seed))
        return
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist())
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as "
                         "UTF-8 JSON / JSON lines, or use parquet") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # not one JSON document: JSON lines
    if isinstance(data, list):
        yield from enumerate(data)
        return
    if isinstance(data, dict):
        yield 0, data
        return
    for row, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            yield row, json.loads(line)
        except json.JSONDecodeError as e:
            yield row, MalformedRow(f"invalid JSON: {e}")


def detect_format(record: Any) -> str | None:
    """The format of a row from its keys, or None."""
    if not isinstance(record, dict):
        return None
    for key, fmt in (("conversations", "sharegpt"), ("messages", "openai"), ("output", "alpaca")):
        if key in record:
            return fmt
    return None


def _text(value: Any, where: str) -> str:
    """A turn's text: a string, or OpenAI content parts [{"type": "text", "text": ...}] joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, np.ndarray)) and all(isinstance(p, dict) for p in value):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
    raise MalformedRow(f"{where} has no string content")


def record_turns(record: Any, fmt: str) -> list[tuple[str, str]]:
    """(role, text) turns of one row in `fmt`, roles normalised (system | user | assistant | tool)."""
    if not isinstance(record, dict):
        raise MalformedRow(f"row is a {type(record).__name__}, expected a dict")
    system = record.get("system")
    turns = []
    if isinstance(system, str) and system:
        turns.append(("system", system))
    if fmt == "alpaca":
        instruction, inp, output = record.get("instruction"), record.get("input"), record.get("output")
        parts = [p for p in (instruction, inp) if isinstance(p, str) and p]
        if not parts or not isinstance(output, str):
            raise MalformedRow("alpaca row needs instruction/input and a string output")
        return turns + [("user", "\n".join(parts)), ("assistant", output)]
    key, role_key, text_key = ("conversations", "from", "value") if fmt == "sharegpt" else \
        ("messages", "role", "content")
    value = record.get(key)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise MalformedRow(f"missing or empty {key!r}")
    for k, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise MalformedRow(f"{key}[{k}] is a {type(turn).__name__}, expected a dict")
        role = ROLES.get(turn.get(role_key))
        if role is None:
            raise MalformedRow(f"{key}[{k}] has unknown {role_key}={turn.get(role_key)!r}")
        turns.append((role, _text(turn.get(text_key), f"{key}[{k}]")))
    return turns


def _is_result(text: str) -> bool:
    s = text.strip()
    return s.startswith("<result>") and s.endswith("</result>")


def splice_result(text: str) -> str:
    """A tool result as the rollout appends it to the assistant turn (spec 3.3): ' <result>\\n{s}\\n</result>'."""
    s = text.strip()
    if _is_result(s):
        s = s[len("<result>"):-len("</result>")].strip()
    return " <result>\n" + s + "\n</result>"


def to_messages(turns: Sequence[tuple[str, str]]) -> list[dict]:
    """Chat messages in the rollout's shape: tool results (and `<result>` user turns right after an assistant turn)
    spliced into that assistant turn, and the assistant text after them continuing it (module docstring)."""
    out: list[dict] = []
    after_tool = False
    for k, (role, text) in enumerate(turns):
        if role == "user" and out and out[-1]["role"] == "assistant" and _is_result(text):
            role = "tool"
        if role == "system" and out:
            raise MalformedRow(f"turn {k}: a system turn after the start of the conversation")
        if role == "tool":
            if not out or out[-1]["role"] != "assistant":
                raise MalformedRow(f"turn {k}: a tool result that does not follow an assistant turn")
            out[-1]["content"] += splice_result(text)
        elif role == "assistant" and after_tool:
            out[-1]["content"] += text
        else:
            if role == "assistant" and not any(m["role"] == "user" for m in out):
                raise MalformedRow(f"turn {k}: an assistant turn before any user turn")
            out.append({"role": role, "content": text})
        after_tool = role == "tool"
    if not any(m["role"] == "assistant" for m in out):
        raise MalformedRow("no assistant turn")
    return out


# ----------------------------------------------------------------------------------------------- tokenising


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _cut_after_end_marker(text: str, start: int, end: int) -> int:
    """End of an assistant span: right after its last end-of-turn marker, else without trailing whitespace."""
    span = text[start:end]
    cut = max((span.rfind(m) + len(m) for m in END_MARKERS if m in span), default=-1)
    return start + cut if cut >= 0 else start + len(span.rstrip())


def assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of the assistant turns in `text` (the full render), end-of-turn marker included.

    Raises:
      MalformedRow: the template rewrites an assistant turn so that it cannot be located in the text.
    """
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[:i + 1])
        if len(head) < len(upto) and text.startswith(upto) and upto.startswith(head):
            start = len(head)
            end = _cut_after_end_marker(text, start, len(upto))
        else:  # the template renders history differently from the full conversation: find the content itself
            start = text.find(m["content"], cursor)
            if start < 0 or not m["content"]:
                raise MalformedRow(f"assistant turn {i} not found in the rendered chat template")
            end = start + len(m["content"])
            end += len(next((mk for mk in END_MARKERS if text.startswith(mk, end)), ""))
        spans.append((start, end))
        cursor = end
    return spans


def char_mask(text: str, spans: Sequence[tuple[int, int]], *, mask_tool_results: bool) -> np.ndarray:
    """[len(text)] bool: the characters that carry loss."""
    mask = np.zeros(len(text), bool)
    for start, end in spans:
        mask[start:end] = True
        if mask_tool_results:
            for m in RESULT_RE.finditer(text, start, end):
                mask[m.start():m.end()] = False
    return mask


def _raw_final_turn(tokenizer, messages: list[dict], text: str) -> str:
    """`text` with a final assistant turn that the template rewrote put back verbatim.

    Some templates edit the assistant text (Qwen3's keeps only what follows the LAST `</think>`, plus the first
    think block, which mangles an ARPO trajectory with several). The rollout never renders the response through
    the template: it is the prompt with the generation prompt, then the model's raw text and EOS. So the final
    turn is rendered that way: generation prompt + content + the template's end-of-turn marker and what follows.
    """
    last = messages[-1]
    if last["role"] != "assistant" or not last["content"] or last["content"] in text:
        return text
    head = _render(tokenizer, messages[:-1], generation_prompt=True)
    tail = text[len(head):] if text.startswith(head) else ""
    marker = next((mk for mk in END_MARKERS if mk in tail), tokenizer.eos_token or "")
    rest = tail[tail.rfind(marker) + len(marker):] if marker and marker in tail else ""
    return head + last["content"] + marker + rest


def encode_messages(tokenizer, messages: list[dict], *, mask_tool_results: bool = True) -> tuple[np.ndarray,
                                                                                                 np.ndarray]:
    """(ids [L] int32, loss_mask [L] int32) of a conversation rendered with the tokenizer's chat template.

    The ids are `tokenizer(render(messages), add_special_tokens=False)`, as the RL prompts are encoded (spec 2.2).
    """
    text = _raw_final_turn(tokenizer, messages, _render(tokenizer, messages))
    chars = char_mask(text, assistant_spans(tokenizer, messages, text), mask_tool_results=mask_tool_results)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int32)
    offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)  # [L, 2] character [start, end)
    # Untrained characters before each position: a token is trained iff its [s, e) holds none of them.
    untrained = np.concatenate([[0], np.cumsum(~chars)])
    s, e = offsets[:, 0], offsets[:, 1]
    mask = (e > s) & (untrained[e] - untrained[s] == 0)
    return ids, mask.astype(np.int32)


# ----------------------------------------------------------------------------------------------- loading


def _check_files(files: str | Sequence[str]) -> list[str]:
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not files:
        raise ValueError("no SFT files given (sft.train_files is empty)")
    files = [f if f == BUILTIN_TOY else os.path.expandvars(os.path.expanduser(str(f))) for f in files]
    for f in files:
        if f != BUILTIN_TOY and not os.path.isfile(f):
            raise FileNotFoundError(f"SFT file not found: {f} (sft.train_files)")
    return files


def _file_format(records: list[tuple[int, Any]], fmt: str, path: str) -> str | None:
    if fmt != "auto":
        return fmt
    found = next((detect_format(r) for _, r in records if detect_format(r)), None)
    if found is None:
        log.warning("%s: no row has `conversations`, `messages` or `output`; the whole file is skipped", path)
    return found


def load_sft_examples(files: str | Sequence[str], tokenizer, *, cutoff_len: int, format: str = "auto",
                      mask_tool_results: bool = True, seed: int = 0) -> SFTDataset:
    """Reads, converts and tokenises SFT files (module docstring) into an `SFTDataset`, files concatenated in order.

    Args:
      files: JSON / JSON-lines / parquet paths, or "builtin:toy" (`toy_sft_conversations`).
      tokenizer: an HF fast tokenizer with a chat template.
      cutoff_len: longer examples keep their first `cutoff_len` tokens (loss only on those); an example with no
        trained token left is dropped and counted.
      format: "auto" (per file, from its rows' keys), "sharegpt", "openai" or "alpaca".
      mask_tool_results: loss 0 on `<result>...</result>` inside assistant turns (False: LLaMA-Factory's behaviour).
      seed: seed of the generated toy conversations.

    Raises:
      FileNotFoundError: a file does not exist. ValueError: bad arguments, or no valid example at all.
    """
    if format not in FORMATS:
        raise ValueError(f"SFT format={format!r}; allowed: {FORMATS}")
    if cutoff_len < 2:
        raise ValueError(f"sft.cutoff_len must be at least 2, got {cutoff_len}")
    if not getattr(tokenizer, "chat_template", None) or not getattr(tokenizer, "is_fast", False):
        raise ValueError("SFT needs a fast tokenizer with a chat template (model.tokenizer / model.path)")
    files = _check_files(files)
    examples, skipped, truncated, dropped = [], [], 0, 0
    for f in files:
        records = list(read_records(f, seed=seed))
        fmt = _file_format(records, format, f)
        for row, record in records:
            try:
                if isinstance(record, MalformedRow):
                    raise record
                if fmt is None:
                    raise MalformedRow("unknown row format")
                ids, mask = encode_messages(tokenizer, to_messages(record_turns(record, fmt)),
                                            mask_tool_results=mask_tool_results)
            except Exception as e:  # noqa: BLE001 -- one bad row (or a template that rejects it) never stops a run
                if len(skipped) < _MAX_WARNINGS:
                    log.warning("skipping %s row %d: %s", f, row, e)
                skipped.append((f, row, f"{type(e).__name__}: {e}" if not isinstance(e, MalformedRow) else str(e)))
                continue
            if len(ids) > cutoff_len:
                truncated += 1
                ids, mask = ids[:cutoff_len], mask[:cutoff_len]
            if not mask[1:].any():  # token 0 is never predicted
                dropped += 1
                continue
            examples.append((ids, mask))
    if skipped:
        log.warning("skipped %d malformed SFT row(s) of %s", len(skipped), files)
    if truncated or dropped:
        log.info("%d SFT example(s) truncated to sft.cutoff_len=%d, %d dropped (nothing left to train on)",
                 truncated, cutoff_len, dropped)
    if not examples:
        reasons = "; ".join(sorted({r for _, _, r in skipped})[:3])
        raise ValueError(f"no valid SFT examples in {files} (sft.train_files): {len(skipped)} malformed row(s) "
                         f"skipped{f' ({reasons})' if reasons else ''}, {dropped} with nothing to train on after "
                         f"sft.cutoff_len={cutoff_len}")
    return SFTDataset(examples, tuple(files), skipped, truncated, dropped)
