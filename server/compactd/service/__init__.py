"""The application layer: sessions held in memory over the store, and the services built on them."""
