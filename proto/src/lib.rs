//! kvroute gRPC protocols (being written).
