package sink

// IsRefusal is isRefusal, for the tests of package sink_test.
var IsRefusal = isRefusal
