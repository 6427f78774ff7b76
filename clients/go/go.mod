module compactd.dev/client

go 1.19

// The offline build (./gotest) ignores this file: it compiles in GOPATH mode against the Go
// sources Debian bookworm packages under /usr/share/gocode (grpc-go 1.33.3, protobuf-go 1.28.1).
// In module mode, with a module proxy, run `go mod tidy` first to pin the rest (genproto's
// errdetails, golang/protobuf).
require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
