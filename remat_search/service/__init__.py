"""The service: workers, the HTTP server and its page."""
