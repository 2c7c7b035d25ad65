"""The prompts a policy sees: the system prompts and the system + user chat messages, built in one place.

The RL data (spec 2.1) stores every prompt as two chat messages, the system prompt and the bare question; the SFT
conversations, the evaluation, the chat and the demo build the same two messages with `chat_messages`.

Which system prompt: the one the model was trained on. The reference's parquet files store its two `\\boxed` as the
backspace byte + "oxed" (a Python "\\b" escape accident, spec 2.3 / B13), and models trained on them saw those
bytes: `REFERENCE_DATA_SYSTEM_PROMPT` reproduces them. The built-in toy tasks were written with a real `\\boxed`
(`SYSTEM_PROMPT`), and the demo uses a shorter prompt (`DEMO_SYSTEM_PROMPT`). `components.system_prompt_for(cfg)`
picks the one that matches a config's training data, so an evaluation shows a model the prompt it learnt from (spec
B17's fix) rather than a corrected prompt it never saw: this is a property of the trained weights, not a reference bug a
default could repair. `data.system_prompt` names one explicitly (`SYSTEM_PROMPTS`), e.g. `demo` for a demo-trained
model or `no_tools` for a baseline without tools (`NO_TOOLS_SYSTEM_PROMPT`, with `tools.call_limit=0`).
"""

from __future__ import annotations

# The reference system prompt (spec 2.3), with a real backslash in \boxed.
SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the "
    "wikipedia search tool and python interpreter tool. Given a question, you need to first think about "
    "the reasoning process in the mind and then provide the answer. During thinking, you can invoke the "
    "wikipedia search tool to search and python interpreter tool to calculate the math problem for fact "
    "information about specific topics if needed. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags respectively, and the search query and result are "
    "enclosed within <search> </search> and <result> </result> tags respectively. For example, <think> "
    "This is the reasoning process. </think> <search> search query here </search> <result> search result "
    "here </result> <think> This is the reasoning process. </think> <python> python code here </python> "
    "<result> python interpreter result here </result> <think> This is the reasoning process. </think> "
    "<answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of the answer, "
    "the final exact answer is enclosed within \\boxed{} with latex format."
)

# The demo's shorter system prompt (~70 tokens instead of ~270: every rollout, validation and training row carries
# it, and on a CPU that is most of the prompt). Same tags, same answer format, same reward.
DEMO_SYSTEM_PROMPT = (
    "Solve the question with tools. Think inside <think> </think>. To compute, write Python that prints the "
    "result inside <python> </python>; to look a fact up, write a query inside <search> </search>. Each tool's "
    "output comes back inside <result> </result>. End with <answer> \\boxed{answer} </answer>."
)

# A baseline without tools (`arpo-jax eval --no-tools`): the same answer format, so the same reward scores it, and no
# word about tools (a model told about tags it may not use would use them).
NO_TOOLS_SYSTEM_PROMPT = (
    "Solve the question step by step. Think inside <think> </think>. End with <answer> \\boxed{answer} </answer>."
)

# The system prompt of every reference RL parquet file (spec 2.3): SYSTEM_PROMPT with its two `\boxed` stored as the
# backspace byte + "oxed".
REFERENCE_DATA_SYSTEM_PROMPT = SYSTEM_PROMPT.replace("\\boxed", "\x08oxed")

# `data.system_prompt`'s names ("auto": the training data's, `components.system_prompt_for`).
SYSTEM_PROMPTS = {"reference": REFERENCE_DATA_SYSTEM_PROMPT, "toy": SYSTEM_PROMPT, "demo": DEMO_SYSTEM_PROMPT,
                  "no_tools": NO_TOOLS_SYSTEM_PROMPT}


def chat_messages(question: str, system_prompt: str = REFERENCE_DATA_SYSTEM_PROMPT) -> list[dict]:
    """``[{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]``: a prompt as the
    RL data stores it, to be rendered with the tokenizer's chat template and the generation prompt (spec 2.2)."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
