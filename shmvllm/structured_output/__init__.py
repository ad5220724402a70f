"""Structured outputs (JSON schema, regex, choice, grammar, json_object, structural tag) with xgrammar.

Where each part runs:
- frontend (`validator`): the constraint is parsed when the request is made, so a bad one is a
  ValueError at generate() naming the field, before anything is queued;
- the ring carries only the StructuredOutputsParams (inside SamplingParams): compiled grammars
  and matchers never cross the process boundary;
- engine, scheduler (`manager`, `compiler`, `request`): grammars compile on a worker thread,
  cached per (tokenizer, constraint); a request waits (status WAITING_FOR_FSM) until its grammar
  is ready while the batch goes on; each step fills the bitmask rows of the constrained requests
  that sample, and each sampled token advances its request's matcher; a request whose grammar
  has ended finishes with finish_reason "stop";
- engine, runner (`bitmask`): the rows are applied to the logits before sampling, so greedy,
  temperature, top-p/k and min-p all choose among allowed tokens only.
"""
