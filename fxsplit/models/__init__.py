"""Small reference models written the way serving engines write them, for tests and demos."""
