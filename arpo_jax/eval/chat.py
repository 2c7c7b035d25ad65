"""`arpo-jax chat`: ask a model questions and watch it use the tools, through the same agent loop as training.

Questions are read from standard input one line at a time (piped input works: ``echo "What is 2^10?" | arpo-jax
chat --model DIR``); an empty line or end of input ends the session. Each question gets the training prompt and one
trajectory of the training agent loop with the real tools (``runner.build_agent``: the config's tools, call limit
and lengths), greedy unless ``--temperature`` says otherwise, and a transcript is printed: the model's text, each tool
call's result (indented), and the answer ``scoring.extract_prediction`` grades.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from typing import TextIO

from ml_collections import ConfigDict

from arpo_jax.eval import agent as agent_lib
from arpo_jax.eval.scoring import extract_prediction

_RESULT = re.compile(r"<result>\n?(.*?)\n?</result>", re.DOTALL)
_CALL = re.compile(r"<(python|search)>.*?</\1>\s*$", re.DOTALL)
_INDENT = "    "


def format_transcript(question: str, response: str, *, tool_calls: int, finish_reason: str, seconds: float) -> str:
    """A readable transcript of one trajectory: question, model text, tool results, answer."""
    lines = [f"user: {question}"]
    pos = 0
    for m in _RESULT.finditer(response):
        text = response[pos:m.start()].strip()
        call = _CALL.search(text)
        lines.append(f"assistant: {text}" if text else "assistant:")
        lines.append(f"{call.group(1) if call else 'tool'} result:")
        lines += [_INDENT + line for line in (m.group(1).splitlines() or [""])]
        pos = m.end()
    tail = response[pos:].strip()
    if tail or pos == 0:
        lines.append(f"assistant: {tail}")
    lines.append(f"answer: {extract_prediction(response)}")
    lines.append(f"[{tool_calls} tool call(s), finish: {finish_reason}, {seconds:.1f} s]")
    return "\n".join(lines)


def chat(cfg: ConfigDict, model: str, *, workdir: str | None = None, engine: str | None = None,
         tokenizer: str | None = None, base_url: str | None = None, served_model: str | None = None,
         api_key_env: str | None = None, temperature: float = 0.0, seed: int | None = None,
         stdin: TextIO | None = None, stdout: TextIO | None = None) -> dict:
    """Runs the chat loop until an empty line or end of input; returns ``{"questions", "tool_calls", "answers"}``.

    Args:
      cfg: the experiment config (``runner.load_eval_config``).
      model, engine, tokenizer, base_url, served_model, api_key_env: as for ``arpo-jax eval``.
      workdir: where ``builtin:tiny`` is built / a checkpoint exported for vLLM; default a temporary folder.
      temperature: 0 = greedy (default).
      seed: sampling seed (default the config's); question i uses ``seed + i``.
    """
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    with tempfile.TemporaryDirectory(prefix="arpo_jax_chat_") as tmp:
        agent = agent_lib.build_agent(cfg, model, workdir=workdir or tmp, engine=engine, tokenizer=tokenizer,
                                   base_url=base_url, served_model=served_model, api_key_env=api_key_env,
                                   rows=1)
        seed = agent.cfg.seed if seed is None else seed
        answers, calls = [], 0
        try:
            interactive = stdin.isatty()
            while True:
                if interactive:
                    print("> ", end="", file=stdout, flush=True)
                line = stdin.readline()
                question = line.strip()
                if not question:
                    break
                t0 = time.perf_counter()
                try:
                    out = agent.run([agent.prompt_ids(question)], n=1, seed=seed + len(answers),
                                    temperature=temperature)
                except Exception as e:  # noqa: BLE001 - e.g. a question over data.max_prompt_length: say so, go on
                    print(f"user: {question}\nerror: {type(e).__name__}: {e}\n", file=stdout, flush=True)
                    answers.append(None)
                    continue
                response = agent.responses(out)[0]
                calls += int(out.tool_calls[0])
                answers.append(extract_prediction(response))
                print(format_transcript(question, response, tool_calls=int(out.tool_calls[0]),
                                        finish_reason=str(out.finish_reason[0]), seconds=time.perf_counter() - t0),
                      file=stdout, flush=True)
                print(file=stdout, flush=True)
        finally:
            agent.close()
    return {"questions": len(answers), "tool_calls": calls, "answers": answers}
