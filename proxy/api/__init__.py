"""HTTP routes only: they parse, delegate and shape the answer."""
