"""workbench: EAGLE-3 speculative decoding with an MLA draft, made visible."""
