//! capstore
