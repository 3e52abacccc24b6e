"""The command line: the app, what it prints, the doctor."""
