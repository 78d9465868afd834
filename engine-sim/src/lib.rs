//! kvroute-engine-sim (being written).
