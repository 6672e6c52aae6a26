//! Tests of the Redis tier against a real `redis-server`.
