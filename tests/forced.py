"""Models whose next id after chosen ids is known in advance, so generators and engines return a script.

`write_forced_model` changes real weights (no wrapper), so the same folder forces the same ids in the Hugging Face
generator, in a vLLM engine and in OpenRLHF's actors.
"""

from __future__ import annotations

from stare_agent.lab.models import scripted_successors, write_scripted_model

chains_to_successors = scripted_successors
"""{id: the id after it} from id chains; chains must agree wherever they share an id."""


def write_forced_model(source, target, successors: dict[int, int], reserved: int = 32):
    """A copy of the model in `source` whose next id after any key of `successors` is its value (probability ~1):
    lab.models.write_scripted_model with 32 reserved dimensions, whatever the script's length."""
    return write_scripted_model(source, target, successors, reserved=reserved)


# --- the Qwen script: stop strings inside merged tokens of the real vocabulary --------------------------------------

QWEN_CALL = "```python print(7*3)</code>\n\n"
"""A tool call whose stop string starts inside `)</` and ends inside `>ĊĊ` (two newlines sampled with it)."""
QWEN_OUTPUT = "21"
QWEN_ANSWER = "\\boxed{21}</answer>."
"""The answer, whose stop string ends inside `>.`."""


def qwen_script(tokenizer) -> dict:
    """Ids of the forced Qwen script and its successors: after the generation prompt's last id (the newline of
    `<|im_start|>assistant\\n`) the call; after the observation of QWEN_OUTPUT (tokenized alone) the answer.
    Every id a generation call samples after is distinct, so a forced model writes exactly these ids."""
    from stare_agent import protocol

    (start,) = protocol.encode_segment(tokenizer, "\n")
    call = protocol.encode_segment(tokenizer, QWEN_CALL)
    observation = protocol.encode_segment(tokenizer, protocol.observation(QWEN_OUTPUT))
    answer = protocol.encode_segment(tokenizer, QWEN_ANSWER)
    assert tokenizer.convert_ids_to_tokens(call[-3:]) == [")</", "code", ">ĊĊ"]
    assert tokenizer.convert_ids_to_tokens(answer[-3:]) == ["}</", "answer", ">."]
    successors = chains_to_successors([[start, *call], [observation[-1], *answer]])
    return {"start": start, "call": call, "observation": observation, "answer": answer, "successors": successors}


class Recording:
    """A generate_batch that records the ids each call conditions on, then calls the real generator."""

    def __init__(self, generator):
        self.generator, self.inputs = generator, []

    def __call__(self, prompts, budgets):
        self.inputs.append([list(p) for p in prompts])
        return self.generator(prompts, budgets)
