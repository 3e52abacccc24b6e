"""Reading studies: results, the front, the best plan at a budget, pictures."""
