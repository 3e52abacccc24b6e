"""Models written as their users write them, which the tests search without editing them."""
