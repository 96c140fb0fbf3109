"""How `select` picks a choice from the logprobs of each choice's tokens: SGLang's three methods.

A method is called with keyword arguments (SGLang's interface, so a program's own
method works too) and returns a `ChoicesDecision`: the chosen text and the
meta info that `s.get_meta_info(name)` reports. Every entry of a token list is
`[logprob, token_id, token_text]`; the methods read only the logprob.
"""

from __future__ import annotations

# one implementation, shared with the server's `choices` request
from radixlm.runtime.constrained.choices import (  # noqa: F401
    BY_NAME, ChoicesDecision, ChoicesSamplingMethod, GreedyTokenSelection, TokenLengthNormalized,
    UnconditionalLikelihoodNormalized, as_method, greedy_token, greedy_token_selection, token_length_normalized,
    unconditional_likelihood_normalized,
)
