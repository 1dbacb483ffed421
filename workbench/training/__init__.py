"""Training of the embedded tiny-kimi pair: corpus, tokenizer, verifier, EAGLE-3 draft."""
