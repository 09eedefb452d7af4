"""specdemo: exact speculative decoding you can watch, trust and measure."""

__version__ = "0.1.0"
