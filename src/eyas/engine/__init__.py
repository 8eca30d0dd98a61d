"""eyas' own speculative decoding engine: target and drafter runners, plain and speculative decoding."""
