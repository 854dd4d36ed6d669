"""A conversation trace shaped by Mooncake's published statistics, scaled to this machine and seeded.

Mooncake's FAST'25 trace release (kvcache-ai/Mooncake, `conversation_trace`)
gives, for its conversation workload: 12,031 requests in one hour, a mean
input of 12,035 tokens and a mean output of 343, prompts hashed in blocks
of 512 tokens; a conversation's next turn comes a median 117 s after the
turn before it, with a median 406 other requests between them; 84% of the
next turns extend the previous prompt whole.  The trace itself holds only
block hashes, so every replay client makes up the text; this one does too.

What is kept and how it is scaled (the constants below):

- The shape of the traffic: conversations of CONV_TURNS turns among single
  requests, each next turn arriving after a log-normal gap whose median is
  the trace's 117 s as a share of its hour (3.25%: with the trace's 3.34
  requests a second, the 406 requests between), scaled to this trace's
  span; the arrivals of conversations and single requests a Poisson process.
  A next turn extends the previous prompt whole (84%): the previous
  messages, an assistant answer and a new user message; the others replace
  the previous turn's user message (an edit: they share the prompt up to it).
- Prompt lengths log-normal (sigma INPUT_SIGMA) with the trace's mean scaled
  by INPUT_SCALE and clipped to [MIN_INPUT, MAX_INPUT]: the trace's 12,035
  tokens on a real model on real hardware take what about 1,850 take on
  this machine's CPU with the bench model.  Outputs likewise, scaled by
  OUTPUT_SCALE (a decode step here costs what a real model's does; the
  output sets how long a request stays in the batch).
- The times: arrivals are given as a share of the trace's span (0 to 1); a
  replay chooses the span (bench/serve_trace.py sets it from the machine's
  measured capacity).

The assistant answers in the history are the trace's own fixed texts, not
what a server answered: every server is sent the same prompts, byte for
byte, whatever it generated.  The texts are cut from kvstore's demo corpus
(standard-library docstrings) at seeded offsets, each its own, so no two
requests share a prefix that the trace does not say they share.
"""

import dataclasses
import math
import random

# Mooncake's conversation trace (FAST'25 release), as published.
MOONCAKE_REQUESTS_PER_HOUR = 12031
MOONCAKE_MEAN_INPUT = 12035
MOONCAKE_MEAN_OUTPUT = 343
MOONCAKE_NEXT_TURN_P50_S = 117
MOONCAKE_EXTEND_SHARE = 0.84

# Scaled to this machine (module docstring).
INPUT_SCALE = 1400 / MOONCAKE_MEAN_INPUT
OUTPUT_SCALE = 1 / 16
INPUT_SIGMA = 1.0                 # log-normal spread of the prompt lengths
MIN_INPUT, MAX_INPUT = 100, 14000
MIN_OUTPUT, MAX_OUTPUT = 4, 64
NEXT_TURN_SIGMA = 0.6             # log-normal spread of the gap between turns
NEXT_TURN_SHARE = MOONCAKE_NEXT_TURN_P50_S / 3600
CONV_TURNS = (3, 6)               # turns of a conversation, uniform
TEMPLATE_TOKENS = 8               # a chat message's markers, at most (kvstore.demo's template: 4)
NEW_TURN_SHARE = 0.25             # a next turn's new user text, as a share of a fresh prompt's length


@dataclasses.dataclass
class Request:
    """One request of the trace."""
    index: int
    at: float                     # arrival, as a share of the trace's span
    messages: list                # the chat messages, fixed
    max_tokens: int
    conversation: int = -1        # -1: a single request
    turn: int = 0
    previous: int = -1            # the index of the conversation's turn before, or -1
    reusable: int = 0             # tokens shared with the previous turn's prompt (set by measure())
    prompt_tokens: int = 0        # set by measure()


class Texts:
    """Distinct texts of n tokens, cut from a corpus at seeded offsets."""

    def __init__(self, tok, corpus, rng):
        self.tok, self.rng = tok, rng
        self.corpus = corpus + "\n\n" + corpus          # room to wrap around
        self.half = len(corpus)
        self.used = set()

    def take(self, n):
        from kvstore.demo.model import text_of_tokens
        while True:
            at = self.rng.randrange(self.half)
            if at in self.used:
                continue
            self.used.add(at)
            text = text_of_tokens(self.tok, self.corpus[at:at + n * 8 + 64], n)
            if text is not None:
                return text


def _lognormal(rng, mean, sigma, lo, hi):
    """A log-normal draw with this mean (not median), clipped to [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def _arrivals(rng, n):
    """n sorted Poisson arrival times over [0, 1)."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(t)
    end = t + rng.expovariate(1.0)
    return [a / end for a in out]


def _plan(rng, requests, conversations):
    """[(start share, [turn gaps as shares])] of each conversation, and the starts of single requests."""
    turns = [rng.randint(*CONV_TURNS) for _ in range(conversations)]
    singles = requests - sum(turns)
    if singles < 0:
        raise ValueError(f"{conversations} conversations need {sum(turns)} requests, more than {requests}")
    starts = _arrivals(rng, conversations + singles)
    rng.shuffle(starts)
    median = math.log(NEXT_TURN_SHARE)
    convs = [(starts[i], [rng.lognormvariate(median, NEXT_TURN_SIGMA) for _ in range(turns[i] - 1)])
             for i in range(conversations)]
    return convs, starts[conversations:]


def make_trace(tok, corpus, requests=122, conversations=16, seed=0):
    """The seeded trace: requests in order of arrival (module docstring).

    Args:
        tok: the tokenizer the texts are measured with (kvstore.demo.model.Tokenizer).
        corpus: the text the prompts are cut from.
        requests, conversations: how many in all, and how many conversations among them.

    Returns:
        [Request], sorted by arrival, indexed in that order.
    """
    rng = random.Random(seed)
    texts = Texts(tok, corpus, rng)
    convs, singles = _plan(rng, requests, conversations)

    def fresh():
        return _lognormal(rng, MOONCAKE_MEAN_INPUT * INPUT_SCALE, INPUT_SIGMA, MIN_INPUT, MAX_INPUT)

    def output():
        return _lognormal(rng, MOONCAKE_MEAN_OUTPUT * OUTPUT_SCALE, INPUT_SIGMA, MIN_OUTPUT, MAX_OUTPUT)

    out = [Request(0, at, [{"role": "user", "content": texts.take(fresh())}], output()) for at in singles]
    for c, (start, gaps) in enumerate(convs):
        first = fresh()
        messages, sizes = [{"role": "user", "content": texts.take(first)}], [first]
        at, turn = start, []
        turn.append(Request(0, at, list(messages), output(), conversation=c, turn=1))
        for t, gap in enumerate(gaps, start=2):
            at += gap
            prev = turn[-1]
            grow = max(MIN_INPUT // 2, int(fresh() * NEW_TURN_SHARE))
            room = MAX_INPUT - sum(sizes) - prev.max_tokens - TEMPLATE_TOKENS * 3
            if rng.random() < MOONCAKE_EXTEND_SHARE and room >= MIN_INPUT // 2:
                grow = min(grow, room)
                messages = messages + [{"role": "assistant", "content": texts.take(prev.max_tokens)},
                                       {"role": "user", "content": texts.take(grow)}]
                sizes = sizes + [prev.max_tokens, grow]
            else:                        # an edit of the previous turn's message
                grow = min(grow, sizes[-1])
                messages = messages[:-1] + [{"role": "user", "content": texts.take(grow)}]
                sizes = sizes[:-1] + [grow]
            turn.append(Request(0, at, list(messages), output(), conversation=c, turn=t))
        out += turn
    out.sort(key=lambda r: r.at)
    return _indexed(out)


def _indexed(out):
    """Sets each request's index and its previous turn's index."""
    last = {}
    for i, r in enumerate(out):
        r.index = i
        if r.conversation >= 0:
            r.previous = last.get(r.conversation, -1)
            last[r.conversation] = i
    return out


def measure(trace, render):
    """Sets each request's prompt_tokens and reusable tokens (shared with the previous turn's
    prompt) from render(messages) -> token ids; returns the share of prompt tokens reusable at best."""
    prompts = [render(r.messages) for r in trace]
    for r, p in zip(trace, prompts):
        r.prompt_tokens = len(p)
        if r.previous >= 0:
            q = prompts[r.previous]
            n = 0
            for a, b in zip(p, q):
                if a != b:
                    break
                n += 1
            r.reusable = n
    total = sum(r.prompt_tokens for r in trace)
    return sum(r.reusable for r in trace) / total if total else 0.0


__all__ = ["Request", "make_trace", "measure"]
