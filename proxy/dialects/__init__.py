"""Wire formats ("dialects"): each module only translates its requests into the turn core's
TurnRequest and the turn core's results (plain or streamed) into its answers."""
