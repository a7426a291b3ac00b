"""A captured piece and its entries (one per capture key): capture, bind, replay, results."""
