"""Losses whose gradient is known by construction, for tests that compare gradients of forced forwards."""


class SummedLogprobs:
    """-sum of the response log-probs: its gradient is that of the forwards' summed log-probs."""

    def global_counts(self, mini):
        return None

    def __call__(self, logprobs, micro, counts):
        value = -(logprobs * micro.response_valid).sum()
        return value, {"loss/total": value.detach()}
