"""Messages to token ids and back: chat templates, the fixed-base delta, history matching, output parsing."""
