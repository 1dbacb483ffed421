"""Token healing: a prompt that ends mid-token or in whitespace, continued as if it had not.

Editors send prompts that end in "\\n", "\\n    " or " ". Such a tail is a token the model
almost never saw at the end of a text: training text merges a newline with the next line's
indentation ("\\n    ") and a space with the next word (" return"). So the model, asked to continue
after a lone "\\n", often ends the text at once or loses the indentation.

Healing backs the prompt off by its last token and constrains the first generated token to one
whose bytes start with that token's bytes (the backed-off token itself among them), so the model
chooses how to finish the text the user typed. Only the first token is constrained, by a mask on
the prefill's logits, which plain and speculative decoding apply alike: greedy outputs stay
identical. The emitted text drops the healed prefix, so it continues the prompt as typed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Healing:
    prompt_ids: list[int]  # the prompt without its last token
    prefix: bytes  # what the first generated token's bytes must start with
    typed: str  # the whole prompt's text, which the emitted text continues
    allowed: torch.Tensor  # ids whose bytes start with `prefix` (int64)

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """1-D logits with every token that does not extend the prefix at -inf."""
        out = torch.full_like(logits, float("-inf"))
        out[self.allowed] = logits[self.allowed]
        return out


def _all_token_bytes(tokenizer) -> list[bytes]:
    cached = tokenizer.__dict__.get("_healing_bytes")
    if cached is None:
        cached = tokenizer.__dict__["_healing_bytes"] = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    return cached


def heal(tokenizer, prompt_ids: list[int], special: set[int]) -> Healing | None:
    """The healing for `prompt_ids`, or None when there is nothing to heal: a one-token prompt, a
    special last token, or a last token that no other token extends."""
    if len(prompt_ids) < 2 or prompt_ids[-1] in special or prompt_ids[-1] >= tokenizer.vocab_size:
        return None
    table = _all_token_bytes(tokenizer)
    prefix = table[prompt_ids[-1]]
    allowed = [i for i, b in enumerate(table) if b.startswith(prefix) and i not in special]
    if len(allowed) < 2:
        return None
    return Healing(list(prompt_ids[:-1]), prefix, tokenizer.decode(list(prompt_ids)),
                   torch.tensor(allowed, dtype=torch.long))


def first_piece(tokenizer, healing: Healing, token: int) -> str:
    """The text the first generated token adds to the prompt as typed (its healed prefix dropped)."""
    full = tokenizer.decode(healing.prompt_ids + [token])
    return full[len(healing.typed):] if full.startswith(healing.typed) else tokenizer.token_texts([token])[0]
