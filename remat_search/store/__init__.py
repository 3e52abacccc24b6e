"""The storage: opening studies' databases, the attribute names, the measurement cache and trial liveness."""
