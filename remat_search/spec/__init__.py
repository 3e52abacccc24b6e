"""The spec: the models of a search spec and their loading from YAML."""
